"""One streamed OpenAI request (``/v1/chat/completions`` or ``/v1/completions``) over httpx, timed.

Timing starts just before the request is sent. TTFT is the first chunk that carries output
(content, reasoning content, tool calls or completion text; the role-only opening chunk does not
count); ITL the gaps between such chunks. ``stream_options.include_usage`` is always asked for,
so token counts and ``cached_tokens`` come from the server.

Cancellation (`CancelRule`): the harness closes the stream after N output chunks or T seconds,
as a user interrupting an agent does; the server sees the connection go. Such a request is
``cancelled``, never an error, unless the stream had already ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from glmserve.loadgen.request_record import RequestRecord


@dataclass(frozen=True)
class CancelRule:
    after_chunks: int | None = None
    after_s: float | None = None

    def __post_init__(self) -> None:
        if self.after_chunks is not None and self.after_chunks < 1:
            raise ValueError(f"after_chunks: must be >= 1, got {self.after_chunks}")
        if self.after_s is not None and self.after_s <= 0:
            raise ValueError(f"after_s: must be > 0, got {self.after_s}")


@dataclass
class StreamOutput:
    """What the model said (the agent appends it to the conversation)."""

    text: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by index, arguments joined


class _Cancelled(Exception):
    pass


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message") or err)[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


class StreamClient:
    """Shares one connection pool; ``base_url`` is the server root (``http://host:port``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 256, transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def stream(self, record: RequestRecord, body: dict[str, Any], headers: dict[str, str] | None = None,
                     cancel: CancelRule | None = None, clock_zero: float = 0.0) -> StreamOutput:
        """Send ``body`` (``stream`` and usage are set here) and fill ``record``; never raises for
        what the server or the network did: that goes into ``record.status``."""
        path = "/v1/chat/completions" if record.endpoint == "chat" else "/v1/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        out = StreamOutput()
        start = time.perf_counter()
        record.start_s = start - clock_zero
        limit = min(self.timeout_s, cancel.after_s) if cancel and cancel.after_s else self.timeout_s
        try:
            async with asyncio.timeout(limit):
                await self._send(path, body, headers, record, out, start, cancel)
        except TimeoutError:
            by_cancel = cancel is not None and cancel.after_s is not None and cancel.after_s <= self.timeout_s
            self._end(record, "cancelled" if by_cancel else "error", None if by_cancel else "timeout",
                      None if by_cancel else f"no end after {limit:g} s")
        except _Cancelled:
            self._end(record, "cancelled")
        except httpx.TimeoutException as e:
            self._end(record, "error", "timeout", repr(e))
        except httpx.ConnectError as e:
            self._end(record, "error", "connect", repr(e))
        except httpx.HTTPError as e:
            self._end(record, "error", "connection_lost", repr(e))
        except (ValueError, TypeError, AttributeError) as e:  # a chunk of the wrong shape: this request only
            self._end(record, "error", "bad_chunk", repr(e))
        record.e2e_s = time.perf_counter() - start
        record.finish_timing()
        return out

    @staticmethod
    def _end(record: RequestRecord, status: str, kind: str | None = None, message: str | None = None) -> None:
        record.status, record.error_kind, record.error = status, kind, message

    async def _send(self, path: str, body: dict[str, Any], headers: dict[str, str] | None, record: RequestRecord,
                    out: StreamOutput, start: float, cancel: CancelRule | None) -> None:
        async with self.http.stream("POST", path, json=body, headers=headers) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                self._end(record, "error", f"http_{response.status_code}", _error_message(await response.aread()))
                return
            last = start
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if record.finish_reason is None:
                        self._end(record, "error", "incomplete_stream", "[DONE] before a finish_reason")
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    self._end(record, "error", "bad_chunk", data[:300])
                    return
                if "error" in chunk:
                    err = chunk["error"]
                    self._end(record, "error", "stream_error", str(err.get("message") if isinstance(err, dict) else err))
                    return
                if _take(chunk, record, out):
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.chunks += 1
                    if cancel is not None and cancel.after_chunks is not None and record.chunks >= cancel.after_chunks:
                        raise _Cancelled
            self._end(record, "error", "incomplete_stream", "the stream ended without [DONE]")


def _take(chunk: dict[str, Any], record: RequestRecord, out: StreamOutput) -> bool:
    """Fold one chunk into ``record`` / ``out``; True when it carried output."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", usage.get("cached_tokens"))
        record.cached_tokens = cached if isinstance(cached, int) else None
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    record.finish_reason = choice.get("finish_reason") or record.finish_reason
    delta = choice.get("delta")
    carried = False
    if isinstance(delta, dict):  # chat
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        out.text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            slot = out.tool_calls.setdefault(call.get("index", len(out.tool_calls)), {"id": None, "name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["id"] = call.get("id") or slot["id"]
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
            carried = True
        carried = carried or bool(text)
        tokens = len((choice.get("logprobs") or {}).get("content") or [])
    else:  # completions
        text = choice.get("text") or ""
        out.text += text
        carried = bool(text)
        tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
    if tokens:
        record.chunk_tokens = (record.chunk_tokens or []) + [tokens]
        carried = True
    return carried
