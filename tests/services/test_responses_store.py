"""Stored responses where every router replica reads them: the kvstore's records (in its memory,
or in Redis, surviving a kvstore restart, deletions included), and two real routers sharing one
kvstore, so a conversation started on one continues on the other through ``previous_response_id``,
its input items list on either, and a deletion on one is seen by the other."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import openai
import pytest
from kvstore_fixtures import kvstore
from redis_fixtures import RedisServer, free_port, requires_redis_server
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, serve

from glmserve.services.kvstore.client import AsyncKVStoreClient, KVStoreError
from glmserve.services.router.app import create_app
from glmserve.services.router.responses_store import RECORD_NAMESPACE, KVStoreResponseStore
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"


def _records(port: int, *calls):
    async def run():
        async with AsyncKVStoreClient(f"127.0.0.1:{port}", timeout_s=2.0) as client:
            return [await getattr(client, name)(*args) for name, *args in calls]
    return asyncio.run(run())


def test_records_in_the_kvstore_expire_and_are_checked():
    port = free_port()
    with kvstore(port):
        assert _records(port, ("put_record", "responses", "r1", b"value", 0.3),
                        ("get_record", "responses", "r1"), ("get_record", "responses", "other")) == [
            True, b"value", None]
        asyncio.run(asyncio.sleep(0.4))
        assert _records(port, ("get_record", "responses", "r1")) == [None]
        assert _records(port, ("put_record", "responses", "r2", b"v", 60.0), ("delete_record", "responses", "r2"),
                        ("get_record", "responses", "r2"), ("delete_record", "responses", "r2"),
                        ("delete_record", "responses", "r1")) == [True, True, None, False, False]  # r1 expired
        for bad in [("put_record", "", "k", b"", 1.0), ("put_record", "n", "k", b"", 0.0),
                    ("get_record", "n", "k" * 300), ("delete_record", "", "k")]:
            with pytest.raises(KVStoreError) as e:
                _records(port, bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@requires_redis_server
def test_records_in_redis_survive_a_kvstore_restart(tmp_path: Path):
    redis_server = RedisServer(tmp_path / "redis").start()
    port = free_port()
    try:
        with kvstore(port, redis_url=redis_server.url):
            assert _records(port, ("put_record", "responses", "r1", b"kept", 60.0),
                            ("put_record", "responses", "r2", b"gone", 60.0),
                            ("delete_record", "responses", "r2")) == [True, True, True]
        with kvstore(port, redis_url=redis_server.url):
            assert _records(port, ("get_record", "responses", "r1"), ("get_record", "responses", "r2"),
                            ("delete_record", "responses", "r2")) == [b"kept", None, False]
            redis_server.stop()
            for call in (("get_record", "responses", "r1"), ("delete_record", "responses", "r1")):
                with pytest.raises(KVStoreError) as e:
                    _records(port, call)
                assert e.value.unavailable
    finally:
        redis_server.stop()


@pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")
def test_two_routers_share_one_conversation():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = ScriptedBackend(lambda _: tokenizer.encode("fine"), tokenizer)
    port = free_port()
    with kvstore(port):
        apps = [create_app(backend, tokenizer, MODEL, max_context=1024,
                           response_store=KVStoreResponseStore(f"127.0.0.1:{port}")) for _ in range(2)]
        with serve(apps[0]) as url_a, serve(apps[1]) as url_b:
            a, b = (openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0) for u in (url_a, url_b))
            first = a.responses.create(model=MODEL, input="hello")
            assert b.responses.retrieve(first.id).output_text == "fine"
            second = b.responses.create(model=MODEL, input="and now?", previous_response_id=first.id)
            assert backend.generated[-1][1] == tokenizer.apply_chat_template([
                {"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "and now?"}])
            assert [i.content[0].text for i in a.responses.input_items.list(second.id)] == ["and now?"]
            b.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                a.responses.retrieve(first.id)
            with pytest.raises(openai.BadRequestError):
                a.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    with serve(create_app(backend, tokenizer, MODEL, max_context=1024,
                          response_store=KVStoreResponseStore(f"127.0.0.1:{port}", timeout_s=0.5))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:  # the kvstore is gone: 503, not "not found"
            client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
        assert e.value.status_code == 503
        for call in (client.responses.delete, client.responses.input_items.list):
            with pytest.raises(openai.InternalServerError) as e:
                call(second.id)
            assert e.value.status_code == 503
        assert client.responses.create(model=MODEL, input="fresh", store=False).output_text == "fine"


@requires_redis_server
@pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")
def test_a_router_over_redis_records(tmp_path: Path):
    """Input items and deletions through a kvstore keeping its records in Redis; a record stored
    before input items were kept still reads (with none)."""
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = ScriptedBackend(lambda _: tokenizer.encode("fine"), tokenizer)
    redis_server = RedisServer(tmp_path / "redis").start()
    port = free_port()
    old = {"response": {"id": "resp_old", "object": "response", "output": []}, "messages": [], "tenant": ""}
    try:
        with kvstore(port, redis_url=redis_server.url):
            app = create_app(backend, tokenizer, MODEL, max_context=1024,
                             response_store=KVStoreResponseStore(f"127.0.0.1:{port}"))
            with serve(app) as url:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                kept = client.responses.create(model=MODEL, input=[{"role": "user", "content": "a"},
                                                                   {"role": "user", "content": "b"}])
                gone = client.responses.create(model=MODEL, input="bye")
                client.responses.delete(gone.id)
                _records(port, ("put_record", RECORD_NAMESPACE, "resp_old", json.dumps(old).encode(), 60.0))
                assert client.responses.retrieve("resp_old").id == "resp_old"
                assert client.responses.input_items.list("resp_old").data == []
        with kvstore(port, redis_url=redis_server.url), serve(create_app(
                backend, tokenizer, MODEL, max_context=1024,
                response_store=KVStoreResponseStore(f"127.0.0.1:{port}"))) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            page = client.responses.input_items.list(kept.id, order="asc", limit=1)
            assert [i.content[0].text for i in page.data] == ["a"] and page.has_more
            assert [i.content[0].text for i in page.get_next_page().data] == ["b"]
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(gone.id)
    finally:
        redis_server.stop()
