"""SpecPolicy: how many MTP drafts to propose next step, chosen from what each choice really gave.

Per batch-size bucket (powers of two) there is an incumbent k, used every step. Now and then another k
is tried in a probe: for 2 * PROBE_PAIRS steps the probed k and the incumbent alternate, and each
step's forward (which verified the drafts chosen one step earlier) and drafting (which serves the next
step) are recorded under their own k. Alternating steps see the same machine: step times on a shared
machine drift by tens of percent within seconds, and comparing a probe with older numbers mistakes the
drift for a difference. Rate = tokens per request per step / (forward + drafting seconds), medians of
the probe's samples; tokens per step come from every step that verified drafts. Everything speculation
costs is in the measured times, so where it does not pay (large batches, low acceptance) k = 0 wins.

The probed k replaces the incumbent when faster by HYSTERESIS, and a k > 0 must also beat k = 0 by
MARGIN (a tie is a loss once probing is counted). A k that wins is followed at once by a probe of k + 1
(longer drafts are tried only while drafting pays). The first bucket probes k = 1 against k = 0 at
once; a later new one (a batch growing or shrinking) starts from the incumbent of the nearest
measured bucket and probes after the usual wait, so a batch passing through sizes quickly is not all
probes.
Probes come after `explore_every` steps; each one that leaves the incumbent in place doubles the wait
(up to MAX_EXPLORE_EVERY), so a bucket where speculation keeps losing (large batches) rarely pays for
trying it again. While speculating, probes try one draft fewer and one more in turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

PROBE_PAIRS = 4  # steps of each side in a probe
# A k > 0 must beat k = 0 by this fraction: step times are noisy, and a tie is a loss once the cost
# of probing is counted.
MARGIN = 0.05
HYSTERESIS = 0.03  # a probed k replaces the incumbent only when this much faster (no flip-flopping)
MAX_EXPLORE_EVERY = 512
TOKENS_WINDOW = 32  # steps whose tokens gained per request estimate a k's acceptance


@dataclass
class Probe:
    k: int
    incumbent: int
    left: int = 2 * PROBE_PAIRS  # choices still to make, alternating k and the incumbent
    forward: dict[int, list[float]] = field(default_factory=dict)  # k -> seconds of its steps' forwards
    drafting: dict[int, list[float]] = field(default_factory=dict)

    overtime: int = 0  # choices made since the last alternation while samples were still missing

    def next_choice(self) -> int:
        self.left -= 1
        return self.k if self.left % 2 else self.incumbent

    def has(self, samples: int) -> bool:
        sides = (self.k, self.incumbent)
        return all(len(d.get(k, ())) >= samples for d in (self.forward, self.drafting) for k in sides)


class SpecPolicy:
    def __init__(self, max_drafts: int, explore_every: int = 24):
        if max_drafts < 0:
            raise ValueError("max_drafts: must be >= 0")
        self.max_drafts = max_drafts
        self.explore_every = explore_every
        self.tokens_per_step: dict[int, deque[float]] = {}
        self._current: dict[int, int] = {}  # bucket -> incumbent k
        self._probes: dict[int, Probe] = {}
        self._wait: dict[int, tuple[int, int]] = {}  # bucket -> (steps left until a probe, wait)
        self._turns: dict[int, int] = {}  # bucket -> probes made while speculating (alternates their k)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def record_step(self, batch_size: int, drafts: int, seconds: float, tokens_gained: float) -> None:
        """The forward (and verification) of a pure decode step of `batch_size` requests that
        verified `drafts` drafts each."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        if drafts:
            self.tokens_per_step.setdefault(drafts, deque(maxlen=TOKENS_WINDOW)).append(tokens_gained / batch_size)
        probe = self._probes.get(self.bucket(batch_size))
        if probe is not None and drafts in (probe.k, probe.incumbent):
            probe.forward.setdefault(drafts, []).append(seconds)

    def record_drafting(self, batch_size: int, drafts: int, seconds: float) -> None:
        """Drafting `drafts` tokens for each of `batch_size` decoding requests took `seconds`."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        probe = self._probes.get(self.bucket(batch_size))
        if probe is not None and drafts in (probe.k, probe.incumbent):
            probe.drafting.setdefault(drafts, []).append(seconds)

    def choose(self, batch_size: int, measurable: bool = True) -> int:
        """Drafts per request for the next step of a batch of `batch_size` decoding requests.

        `measurable` False: the next step will not be recorded (prompts are still being prefilled
        alongside), so nothing is tried in it; it gets the incumbent of this batch size or of the
        nearest one measured, else k = 0."""
        if self.max_drafts == 0 or batch_size == 0:
            return 0
        b = self.bucket(batch_size)
        if not measurable:
            return self._settled(b)
        if b not in self._current:
            if self._current:  # start from the nearest measured batch size; probe after the usual wait
                self._current[b] = self._settled(b)
                self._wait[b] = (self.explore_every, self.explore_every)
                return self._current[b]
            self._current[b] = 0  # the very first batch size: one draft against none first
            self._wait[b] = (self.explore_every, self.explore_every)
            return self._start_probe(b, 1)
        probe = self._probes.get(b)
        if probe is not None:
            if probe.left:
                return probe.next_choice()
            # The probe's last forward is recorded after this choice; steps that were not measured
            # (requests finishing, prompts joining) can leave a few samples missing for good.
            if not probe.has(PROBE_PAIRS) and probe.overtime < PROBE_PAIRS:
                probe.overtime += 1
                return probe.incumbent
            del self._probes[b]
            if probe.has(2) and self._judge(b, probe) and probe.incumbent < probe.k < self.max_drafts:
                return self._start_probe(b, probe.k + 1)  # k paid: try one more draft
        if self._probe_due(b):
            return self._start_probe(b, self._neighbour(b, self._current[b]))
        return self._current[b]

    def _judge(self, bucket: int, probe: Probe) -> bool:
        """Whether the probed k replaces the incumbent (then it does)."""
        probed, incumbent = self._rate(probe, probe.k), self._rate(probe, probe.incumbent)
        if probed is None or incumbent is None or probed <= incumbent * (1 + HYSTERESIS):
            return False
        self._current[bucket] = probe.k
        self._wait[bucket] = (2 * PROBE_PAIRS, self.explore_every)  # soon re-check the old choice
        return True

    def _rate(self, probe: Probe, k: int) -> float | None:
        """Tokens per request per second with k drafts, k > 0 discounted by MARGIN."""
        seconds = median(probe.forward[k]) + median(probe.drafting[k])
        if k == 0:
            return 1.0 / seconds
        tokens = self.tokens_per_step.get(k)
        return None if not tokens else median(tokens) / seconds / (1 + MARGIN)

    def _neighbour(self, bucket: int, current: int) -> int:
        """What a probe tries: k = 1 from k = 0, else one draft fewer and one more in turn."""
        if current == 0:
            return 1
        self._turns[bucket] = self._turns.get(bucket, 0) + 1
        return current + 1 if self._turns[bucket] % 2 == 0 and current < self.max_drafts else current - 1

    def _probe_due(self, bucket: int) -> bool:
        """Counts down to the next probe; each probe doubles the wait until the incumbent changes."""
        left, wait = self._wait[bucket]
        if left > 1:
            self._wait[bucket] = (left - 1, wait)
            return False
        wait = min(2 * wait, MAX_EXPLORE_EVERY)
        self._wait[bucket] = (wait, wait)
        return True

    def _settled(self, bucket: int) -> int:
        if not self._current:
            return 0
        nearest = min(self._current, key=lambda x: (abs(x - bucket), -x))  # ties: the larger batch
        return self._current[nearest]

    def _start_probe(self, bucket: int, k: int) -> int:
        probe = Probe(k, self._current[bucket])
        self._probes[bucket] = probe
        return probe.next_choice()
