"""LocalPrefill: when a decode worker should prefill a prompt itself instead of a prefill worker.

Disaggregation pays when the prefill workers keep up: decode streams then never wait behind a
prompt. When prompts queue at the prefill workers, the decode workers' cores are the idle ones
(a decode batch waiting for its next request); computing some prompts there shortens the queue
at the cost of slower decode steps while the chunk runs (as one process would).

Policy (``mode``):

- ``auto``: local when the decode worker would finish this prompt before any prefill worker could
  start it: ``local_queued + (prompt - own hit) <= remote_queued``, where ``remote_queued`` is the
  prefill work ahead of it at the least queued prefill worker (tokens this router queued,
  `PrefixRouter.least_queued_tokens`), ``local_queued`` the tokens this router gave that decode
  worker to prefill that have not produced their first token yet, and ``own hit`` the prompt's
  leading tokens the decode worker already holds (it decoded the earlier turns; told only under
  cache-aware routing, `PrefixRouter.route`). Not the chosen worker's queue: cache-aware
  routing may pick a longer queue for a cache hit, and comparing against it sent those prompts to
  the decode worker without their hit (over HTTP, 1.2-1.45x the TTFT of least-loaded routing).
  With one request at a time nothing is queued, so every prompt goes to a prefill worker; under a
  backlog the work splits between both kinds of core. Also local: prompts of at most
  ``short_tokens`` (the hop costs more than the compute; 0 turns this off).
- ``off``: always a prefill worker (the platform before this policy; a baseline for benchmarks).
- ``always``: always the decode worker (one-process behaviour through the platform; tests).

Reasons (the ``glmserve_router_local_prefills_total`` label): ``backlog``, ``short``, ``always``.
Not thread-safe: the router's event loop owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "off", "always")
REASONS = ("backlog", "short", "always")


@dataclass(frozen=True)
class LocalPrefillConfig:
    mode: str = "auto"
    short_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"local_prefill: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.short_tokens < 0:
            raise ValueError(f"local_prefill_short_tokens: must be >= 0, got {self.short_tokens}")


class LocalPrefill:
    def __init__(self, config: LocalPrefillConfig = LocalPrefillConfig()) -> None:
        self.config = config
        self._queued: dict[str, int] = {}  # decode address -> tokens it is prefilling (beyond its hits)

    def choose(self, decode: str, prompt_tokens: int, remote_queued: int, own_hit_tokens: int = 0) -> str | None:
        """The reason to prefill on ``decode`` (one of REASONS), or None for the prefill worker.
        ``own_hit_tokens``: the prompt's leading tokens ``decode`` holds already."""
        mode = self.config.mode
        if mode != "auto":
            return "always" if mode == "always" else None
        if prompt_tokens <= self.config.short_tokens:
            return "short"
        if self.queued(decode) + prompt_tokens - own_hit_tokens <= remote_queued:
            return "backlog"
        return None

    def queued(self, decode: str) -> int:
        return self._queued.get(decode, 0)

    def acquire(self, decode: str, compute_tokens: int) -> None:
        self._queued[decode] = self.queued(decode) + compute_tokens

    def release(self, decode: str, compute_tokens: int) -> None:
        """The prompt's first token came (or the attempt ended without one)."""
        left = self.queued(decode) - compute_tokens
        if left > 0:
            self._queued[decode] = left
        else:
            self._queued.pop(decode, None)
