"""SpecPolicy: how many MTP drafts to propose next step, chosen from what each choice really gave.

For each batch-size bucket (powers of two) and each k in 0..max_drafts it keeps the last few wall
times of a pure decode step's forward that verified k drafts and of the drafting that proposed k
drafts (MTP forwards, catching up deferred positions included), and for each k the tokens a request
gained per step. A step's forward verifies the drafts chosen one step earlier, while its drafting
serves the next step, so the two are recorded under their own k. Rate = tokens per second. Everything
the engine spends on speculation is in the measured times, so when speculation does not pay (large
batches, low acceptance) k = 0 wins.

Step times are noisy and drift (other processes, the host, context growth), so only measurements
close in time are compared. Each bucket has an incumbent k, run (and measured) every step. Another k
is tried as a probe: PROBE_STEPS consecutive steps, enough for most of its WINDOW samples to be fresh;
right after a probe the probed k replaces the incumbent if it is faster (a k > 0 must be faster by
MARGIN than k = 0's own measurements suggest: a tie is a loss once exploring is counted). A k that
wins is followed at once by a probe of k + 1 (longer drafts are tried only while drafting pays).
Probes come first after `explore_every` steps; each one that leaves the incumbent in place doubles the
wait (up to MAX_EXPLORE_EVERY), so a bucket where speculation keeps losing (large batches) rarely pays
for trying it again. While speculating, probes try one draft fewer and one more in turn.
"""

from __future__ import annotations

from collections import deque
from statistics import median

WINDOW = 7  # samples per estimate
PROBE_STEPS = 4  # consecutive steps a probed k runs: a majority of its WINDOW samples
# A k > 0 must beat k = 0 by this fraction: step times are noisy, and a tie is a loss once the cost
# of exploring is counted.
MARGIN = 0.10
MAX_EXPLORE_EVERY = 512
HYSTERESIS = 0.03  # a probed k replaces the incumbent only when this much faster (no flip-flopping)


class Samples:
    """The last WINDOW observations."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)

    def add(self, x: float) -> None:
        self.values.append(x)

    @property
    def estimate(self) -> float:
        return median(self.values)


class SpecPolicy:
    def __init__(self, max_drafts: int, explore_every: int = 24):
        if max_drafts < 0:
            raise ValueError("max_drafts: must be >= 0")
        self.max_drafts = max_drafts
        self.explore_every = explore_every
        self.step_seconds: dict[tuple[int, int], Samples] = {}
        self.draft_seconds: dict[tuple[int, int], Samples] = {}
        self.tokens_per_step: dict[int, Samples] = {}
        self._current: dict[int, int] = {}  # bucket -> incumbent k
        self._probes: dict[int, tuple[int, int]] = {}  # bucket -> (k being probed, steps left)
        self._probed: dict[int, int] = {}  # bucket -> k whose probe just ended, not yet judged
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
        self.step_seconds.setdefault((self.bucket(batch_size), drafts), Samples()).add(seconds)
        if drafts:
            self.tokens_per_step.setdefault(drafts, Samples()).add(tokens_gained / batch_size)

    def record_drafting(self, batch_size: int, drafts: int, seconds: float) -> None:
        """Drafting `drafts` tokens for each of `batch_size` decoding requests took `seconds`."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        self.draft_seconds.setdefault((self.bucket(batch_size), drafts), Samples()).add(seconds)

    def _rate(self, bucket: int, k: int) -> float | None:
        """Tokens per second with k drafts in this bucket, k > 0 discounted by MARGIN; None until
        measured."""
        step = self.step_seconds.get((bucket, k))
        if k == 0:
            return None if step is None else 1.0 / step.estimate
        gain, draft = self.tokens_per_step.get(k), self.draft_seconds.get((bucket, k))
        if step is None or gain is None or draft is None:
            return None
        return gain.estimate / (step.estimate + draft.estimate) / (1 + MARGIN)

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
        if b in self._probes:
            return self._continue_probe(b)
        if b not in self._current:  # a new bucket: k = 0 first, then a probe of k = 1 right after
            self._current[b] = 0
            self._wait[b] = (1, self.explore_every // 2)
            return self._start_probe(b, 0)
        current, probed = self._current[b], self._probed.pop(b, None)
        if probed is not None and probed != current and self._faster(b, probed, current):
            self._current[b] = probed
            self._wait[b] = (2 * PROBE_STEPS, self.explore_every // 2)  # soon re-check the old choice
            if current < probed < self.max_drafts:
                return self._start_probe(b, probed + 1)  # k paid: try one more draft
            return probed
        if self._probe_due(b):
            return self._start_probe(b, self._neighbour(b, current))
        return current

    def _neighbour(self, bucket: int, current: int) -> int:
        """What a probe tries: k = 1 from k = 0, else one draft fewer and one more in turn."""
        if current == 0:
            return 1
        self._turns[bucket] = self._turns.get(bucket, 0) + 1
        return current + 1 if self._turns[bucket] % 2 == 0 and current < self.max_drafts else current - 1

    def _faster(self, bucket: int, k: int, than: int) -> bool:
        rate, other = self._rate(bucket, k), self._rate(bucket, than)
        return rate is not None and (other is None or rate > other * (1 + HYSTERESIS))

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
        """Run k for PROBE_STEPS steps: most of its window is then fresh."""
        self._probes[bucket] = (k, PROBE_STEPS)
        return self._continue_probe(bucket)

    def _continue_probe(self, bucket: int) -> int:
        k, left = self._probes[bucket]
        if left > 1:
            self._probes[bucket] = (k, left - 1)
        else:
            del self._probes[bucket]
            self._probed[bucket] = k
        return k
