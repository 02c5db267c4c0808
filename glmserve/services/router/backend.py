"""GenerationBackend: what the router needs from whatever generates tokens (one local engine, or
prefill + decode workers over gRPC); it streams `glmserve.core.generation.TokenEvent`s back.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from glmserve.core.generation import SamplingParams, TokenEvent


@dataclass(frozen=True)
class RequestHints:
    """What the router knows about a request besides its tokens (see the README, "Prefix cache").

    - ``session_id``: an agent session (header ``x-session-id``, else the request's ``user``);
      its turns stay on the prefill worker that holds its KV while that worker is not overloaded.
    - ``cache_salt``: the tenant's prefix-cache salt; requests only share cached KV when their
      salts are equal (None: the shared, unsalted cache).
    """

    session_id: str | None = None
    cache_salt: str | None = None


class BackendUnavailable(Exception):
    """The backend cannot take a request now (not started, workers down); the router answers 503."""


class BackendFull(BackendUnavailable):
    """Every worker that could take the request is full now (no KV blocks for it): a state that
    passes, not a failure. The router waits for capacity (`admission.Ticket.wait_for_capacity`)
    and tries again, and answers 429 once the request's queue wait is spent."""


class WorkerUnreachable(BackendUnavailable):
    """The workers the router counts as healthy could not take the request just now, for a reason
    that passes (one restarting behind its address while channels reconnect, a decode worker that
    could not reach its prefill worker, one that began draining): nothing was generated. The
    router waits a moment and tries again within the request's queue wait, then answers 503."""


class GenerationBackend(abc.ABC):
    """Contract every backend keeps (the router relies on each point):

    - ``generate(request_id, prompt_ids, params)`` is an async iterator of `TokenEvent` for that
      request, in order, ending with exactly one event with ``finished``. Its events' ``request_id``
      is the one given. ``request_id`` is unique among running requests (the router makes it).
      ``params`` is already validated and ``len(prompt_ids) + params.max_tokens`` fits the model's
      context. Stop strings in ``params`` are enforced by the backend (it stops generating).
      It may raise `BackendUnavailable` (`BackendFull` when the workers are only full,
      `WorkerUnreachable` when they may take it a moment later) before yielding anything.
    - ``abort(request_id)`` stops the request everywhere at once and frees its resources; it is
      idempotent, never raises for an unknown or finished id, and returns without waiting for a
      generation step. An open stream of that request then ends promptly with a final event whose
      ``finish_reason`` is "abort".
    - If the consumer stops iterating early (``aclose()``, cancellation, an exception), the backend
      aborts the request itself; callers still call ``abort`` when a client goes away (idempotent).
    - ``ready()`` is cheap and non-blocking: True when a new request would be taken now.
    - ``start()`` / ``close()`` bracket the backend's life (the app's lifespan calls them); after
      ``close()`` open streams end with "abort" and ``ready()`` is False.
    """

    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's events (see the class docstring); ``hints`` may steer caching and
        placement, never the tokens."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop the request now (see the class docstring)."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when a new request would be accepted now."""

    def readiness_detail(self) -> dict[str, Any]:
        """Extra fields for ``/ready`` (e.g. where prefix lookups are answered); cheap."""
        return {}

    def metrics_registry(self) -> CollectorRegistry | None:
        """The backend's own Prometheus metrics, served on ``/metrics`` next to the app's."""
        return None

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Begin serving (load models, connect to workers); may return before ``ready()``."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Stop serving and release everything."""
