"""A chat stream read as pieces, and the Responses / Messages objects and events built from them:
calls streamed whole or as argument pieces give the same objects, and the events add up to them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from glmserve.services.router.chat_pieces import (
    CallArguments,
    CallStarted,
    Failed,
    Finished,
    TextPiece,
    stream_pieces,
    whole_pieces,
)
from glmserve.services.router.messages_output import MessageAssembly
from glmserve.services.router.responses_output import ResponseAssembly

USAGE = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 8}}
RUN = SimpleNamespace(output=SimpleNamespace(stop_reason=None))


def _chunk(delta=None, finish=None):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


WHOLE_CALL = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}),
              _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"path": 1}'}}]}),
              _chunk(finish="tool_calls"), {"choices": [], "usage": USAGE}]
PIECED_CALL = WHOLE_CALL[:2] + [
    _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th": 1}'}}]}),
] + WHOLE_CALL[3:]


async def _aiter(items):
    for item in items:
        yield item


def _pieces(chunks):
    async def collect():
        return [p async for p in stream_pieces(_aiter(chunks), RUN)]
    return asyncio.run(collect())


def test_calls_whole_or_in_pieces_read_the_same():
    whole, pieced = _pieces(WHOLE_CALL), _pieces(PIECED_CALL)
    assert whole[:2] == [TextPiece("Hi"), CallStarted(0, "call_1", "f")]
    assert whole[-1] == pieced[-1] == Finished("tool_calls", None, USAGE)
    assert "".join(p.piece for p in pieced if isinstance(p, CallArguments)) == '{"path": 1}'
    body = {"choices": [{"message": {"content": "Hi", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": '{"path": 1}'}}]}, "finish_reason": "tool_calls"}],
        "usage": USAGE}
    assert whole_pieces(body, RUN) == whole[:2] + [CallArguments(0, '{"path": 1}'), whole[-1]]
    assert _pieces([_chunk({"content": "a"}), {"error": {"message": "boom"}}])[-1] == Failed({"message": "boom"})
    assert _pieces([_chunk({"content": "a"})]) == [TextPiece("a")]  # the client left: no Finished


def test_response_events_add_up_to_the_response():
    assembly = ResponseAssembly("resp_1", 0, "m", {})
    events = assembly.start() + [e for p in _pieces(PIECED_CALL) for e in assembly.feed(p)]
    final = events[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"path": 1}' and final["output"][1]["call_id"] == "call_1"
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 4,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert (text, args) == ("Hi", '{"path": 1}')
    assert assembly.assistant_message() == {"role": "assistant", "content": "Hi", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"path": 1}'}}]}


def test_message_events_add_up_to_the_message():
    assembly = MessageAssembly("msg_1", "m")
    events = assembly.start(10, 8) + [e for p in _pieces(PIECED_CALL) for e in assembly.feed(p)]
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    message = assembly.message()
    assert message["content"] == [{"type": "text", "text": "Hi"},
                                  {"type": "tool_use", "id": "call_1", "name": "f", "input": {"path": 1}}]
    assert message["stop_reason"] == "tool_use" and events[-2]["delta"]["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 2, "output_tokens": 4, "cache_read_input_tokens": 8,
                                "cache_creation_input_tokens": 0}
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"path": 1}


REASONED = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "Let me "}),
            _chunk({"reasoning_content": "think."}), _chunk({"content": "Done."}), _chunk(finish="stop"),
            {"choices": [], "usage": USAGE}]


def test_reasoning_becomes_a_reasoning_item_and_a_thinking_block():
    pieces = _pieces(REASONED)
    body = {"choices": [{"message": {"content": "Done.", "reasoning_content": "Let me think."},
                         "finish_reason": "stop"}], "usage": USAGE}
    assert [type(p).__name__ for p in whole_pieces(body, RUN)] == ["ReasoningPiece", "TextPiece", "Finished"]
    responses = ResponseAssembly("resp_1", 0, "m", {})
    events = [e for p in pieces for e in responses.feed(p)]
    output = responses.response()["output"]
    assert [i["type"] for i in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.output_item.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta", "response.reasoning_text.done"]
    # Kept for the next turn: the template shows it while a tool loop runs, and drops it after a new user turn.
    assert responses.assistant_message() == {"role": "assistant", "content": "Done.", "reasoning_content": "Let me think."}
    messages = MessageAssembly("msg_1", "m")
    events = [e for p in pieces for e in messages.feed(p)]
    assert messages.message()["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                             {"type": "text", "text": "Done."}]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "text_delta"]
