"""The transfer timeouts prefill, decode and the kvstore agree on (DESIGN invariant 2), in one place.

A block that is the destination of a write is reused only once the writer says the write has
drained, or, when nobody can say so (the writer died mid-write, its answer was lost), after the
agreed release timeout. That is safe only if every writer gives up on a write and stops touching
its destination well within it: a write still running after ``write_s`` is failed and fenced, its
last bytes land within ``drain_s``, and ``margin_s`` covers the two processes' scheduling slack.

Who reads what (every default derives from `AGREED`; the services' flags override it):
- writers (prefill workers; the kvstore writing host-tier blocks into a worker): ``write_s``,
  ``drain_s``;
- receivers (decode: its Prefill call's deadline and the quarantine of undrained blocks; a worker
  loading host-tier blocks: its load deadline): ``release_s``;
- the kvstore's lease on host rows a worker writes into: ``lease_s`` (the write plus the RPCs
  around it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferTimeouts:
    write_s: float = 50.0
    drain_s: float = 5.0
    margin_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("write_s", "drain_s", "margin_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")

    @property
    def release_s(self) -> float:
        """How long a receiver keeps blocks whose writer could not confirm they drained."""
        return self.write_s + self.drain_s + self.margin_s

    @property
    def lease_s(self) -> float:
        return 2 * self.release_s


AGREED = TransferTimeouts()
