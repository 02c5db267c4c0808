"""``/v1/messages`` (Anthropic's Messages API, what Claude-Code-style agents call): a thin adapter
over the chat path (`OpenAIServing.chat`).

A request becomes a chat request (`messages_bodies`) through the same chat template and the same
`RequestRun`, so prefix caching, sessions (``metadata.user_id`` or ``x-session-id``), admission and
tool_choice enforcement are the chat path's. Its answer, whole or streamed, is reshaped into an
Anthropic message (`messages_output`). Refusals come before any byte of a stream; errors are in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``) with the same statuses.
``POST /v1/messages/count_tokens`` counts the prompt a request would have.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from glmserve.services.router.agent_chat import chat_request, renamed
from glmserve.services.router.chat_pieces import stream_pieces, whole_pieces
from glmserve.services.router.errors import APIError
from glmserve.services.router.messages_bodies import PARAM_NAMES, CountTokensRequest, MessagesRequest
from glmserve.services.router.messages_output import MessageAssembly, error_body
from glmserve.services.router.request_run import RequestContext
from glmserve.services.router.serving import Answer, OpenAIServing


class MessagesAPI:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: MessagesRequest, ctx: RequestContext) -> Answer:
        """``POST /v1/messages``."""
        chat = chat_request(body.chat_body(), PARAM_NAMES)
        try:
            answer = await self.serving.chat(chat, ctx)
        except APIError as e:
            raise renamed(e, PARAM_NAMES) from None
        if answer.status != 200 and answer.body is not None:  # failed after it was accepted
            return Answer(error_body(answer.status, answer.body["error"]["message"]), status=answer.status,
                          headers=answer.headers, run=answer.run)
        if answer.body is None and answer.chunks is None:
            return answer  # 499
        assert answer.run is not None
        assembly = MessageAssembly("msg_" + answer.run.request_id.removeprefix("chatcmpl-"), self.serving.model_name)
        if answer.chunks is not None:
            return Answer(chunks=self._events(answer, assembly), run=answer.run, named_events=True)
        assert answer.body is not None
        assembly.start(len(answer.run.prompt_ids), 0)
        for piece in whole_pieces(answer.body, answer.run):
            assembly.feed(piece)
        return Answer(assembly.message(), run=answer.run)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        """``POST /v1/messages/count_tokens``: the prompt's tokens (the tools' rendering included)."""
        chat = chat_request(body.chat_body(), PARAM_NAMES)
        chat.check_model(self.serving.model_name)
        try:
            ids = await self.serving.chat_prompt(chat.template_messages(), chat.active_tools(),
                                                 chat.chat_template_kwargs)
        except APIError as e:
            raise renamed(e, PARAM_NAMES) from None
        return {"input_tokens": len(ids)}

    async def _events(self, answer: Answer, assembly: MessageAssembly) -> AsyncIterator[dict[str, Any]]:
        assert answer.chunks is not None and answer.run is not None
        run, started = answer.run, False
        async for piece in stream_pieces(answer.chunks, run):
            if not started:  # after the first event: the prompt's cached part is known
                started = True
                for event in assembly.start(len(run.prompt_ids), run.output.num_cached_tokens):
                    yield event
            for event in assembly.feed(piece):
                yield event
