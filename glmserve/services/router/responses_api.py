"""``/v1/responses`` (the OpenAI Responses API, what Codex-style agents call): a thin adapter over
the chat path (`OpenAIServing.chat`).

A request becomes a chat request (`responses_bodies`): the stored conversation of
``previous_response_id`` (`responses_store`), then this input, with ``instructions`` as the system
message in front. Its answer, whole or streamed, is reshaped into a Response (`responses_output`).
Refusals (400, 404, 429, 503) come before any byte of a stream, as on the chat path. With
``store`` (the default) the response, its conversation and its input items (`responses_items`)
are kept for the next turn, for ``GET /v1/responses/{id}`` and ``.../input_items``, until
``DELETE /v1/responses/{id}``; ``store: false`` keeps nothing. A tenant reads and deletes only
what it stored: another tenant's response is a 404, as an unknown one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from glmserve.services.router.agent_chat import chat_request, renamed
from glmserve.services.router.chat_pieces import stream_pieces, whole_pieces
from glmserve.services.router.errors import APIError, from_value_error, invalid_request
from glmserve.services.router.request_run import RequestContext
from glmserve.services.router.responses_bodies import PARAM_NAMES, ResponsesRequest
from glmserve.services.router.responses_items import input_items, item_page
from glmserve.services.router.responses_output import ResponseAssembly
from glmserve.services.router.responses_store import ResponseStore, StoredResponse
from glmserve.services.router.serving import Answer, OpenAIServing


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", None,
                    "not_found")


class ResponsesAPI:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, body: ResponsesRequest, ctx: RequestContext) -> Answer:
        """``POST /v1/responses``."""
        body_messages = await self._conversation(body, ctx.tenant)
        chat = chat_request(body.chat_body(body_messages), PARAM_NAMES)
        try:
            answer = await self.serving.chat(chat, ctx)
        except APIError as e:
            raise renamed(e, PARAM_NAMES) from None
        if answer.status != 200 or (answer.body is None and answer.chunks is None):
            return answer  # an error body (OpenAI's shape is the Responses' too), or 499
        assert answer.run is not None  # an accepted run answers
        response_id = "resp_" + answer.run.request_id.removeprefix("chatcmpl-")  # the logs' id, recognisable
        assembly = ResponseAssembly(response_id, int(time.time()), self.serving.model_name, body.echo())
        if answer.chunks is not None:
            return Answer(chunks=self._events(answer, assembly, body, body_messages, ctx.tenant), run=answer.run,
                          named_events=True)
        assert answer.body is not None
        for piece in whole_pieces(answer.body, answer.run):
            assembly.feed(piece)
        await self._keep(body, assembly, body_messages, ctx.tenant)
        return Answer(assembly.response(), run=answer.run)

    async def get(self, response_id: str, tenant: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: a response ``tenant`` stored, or 404."""
        record = await self._stored(response_id, tenant)
        if record is None:
            raise response_not_found(response_id)
        return record.response

    async def delete(self, response_id: str, tenant: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: forget a response ``tenant`` stored, or 404."""
        record = await self._stored(response_id, tenant)
        if record is None or not await self.store.delete(response_id):
            raise response_not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(self, response_id: str, tenant: str, limit: int, order: Literal["asc", "desc"],
                          after: str | None) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: one page of the request's input items, or 404."""
        record = await self._stored(response_id, tenant)
        if record is None:
            raise response_not_found(response_id)
        return item_page(record.input_items, limit, order, after)

    async def _stored(self, response_id: str, tenant: str) -> StoredResponse | None:
        record = await self.store.get(response_id)
        return record if record is not None and record.tenant == tenant else None

    async def _conversation(self, body: ResponsesRequest, tenant: str) -> list[dict[str, Any]]:
        """The chat messages so far: the previous response's conversation, then this input."""
        try:
            messages = body.input_messages()
        except ValueError as e:
            raise from_value_error(e, "input") from e
        if body.previous_response_id is None:
            return messages
        previous = await self._stored(body.previous_response_id, tenant)
        if previous is None:
            raise invalid_request(f"Previous response with id '{body.previous_response_id}' not found.",
                                  "previous_response_id", "previous_response_not_found")
        return previous.messages + messages

    async def _keep(self, body: ResponsesRequest, assembly: ResponseAssembly, messages: list[dict[str, Any]],
                    tenant: str) -> None:
        if body.store and assembly.status in ("completed", "incomplete"):
            await self.store.put(StoredResponse(assembly.response(), messages + [assembly.assistant_message()],
                                                tenant, input_items(body)))

    async def _events(self, answer: Answer, assembly: ResponseAssembly, body: ResponsesRequest,
                      messages: list[dict[str, Any]], tenant: str) -> AsyncIterator[dict[str, Any]]:
        assert answer.chunks is not None and answer.run is not None
        for event in assembly.start():
            yield event
        async for piece in stream_pieces(answer.chunks, answer.run):
            events = assembly.feed(piece)
            if assembly.status in ("completed", "incomplete"):
                await self._keep(body, assembly, messages, tenant)  # before the client reads the final event
            for event in events:
                yield event
