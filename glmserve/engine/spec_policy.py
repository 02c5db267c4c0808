"""SpecPolicy: how many MTP drafts to propose next step, chosen from what each choice really gave.

For each batch-size bucket (powers of two) and each k in 0..max_drafts it keeps the last few wall
times of a pure decode step's forward that verified k drafts and of the drafting that proposed k
drafts (MTP forwards, catching up deferred positions included), and for each k the tokens a request
gained per step. A step's forward verifies the drafts chosen one step earlier, while its drafting
serves the next step, so the two are recorded under their own k. It picks the k with the most tokens
per second (k > 0 only when it beats k = 0 by a margin). Everything the engine spends on speculation
is in the measured times, so when speculation does not pay (large batches, low acceptance) k = 0 wins.

Step times are noisy (other processes, allocator, Python), so estimates are medians of the last
`WINDOW` samples: one slow step cannot flip the choice. A bucket tries k + 1 only once k has beaten
every shorter choice. Now and then it re-measures the choice whose samples are oldest (the best k is
measured every step; the others go stale): first after `explore_every` steps in the bucket, and each
time that leaves the best k unchanged the wait doubles (up to `MAX_EXPLORE_EVERY`), so a bucket where
speculation keeps losing (large batches) rarely pays for trying it again.
"""

from __future__ import annotations

from collections import deque
from statistics import median

WINDOW = 7  # samples per estimate
# Speculation must beat k = 0 by this fraction: step times are noisy, and a tie is a loss once the
# cost of exploring is counted.
MARGIN = 0.10
MAX_EXPLORE_EVERY = 512
PROBE_STEPS = 4  # consecutive steps an explored k runs: a majority of its WINDOW samples


class Samples:
    """The last WINDOW observations, and when the last one came (a step counter)."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.last_step = 0

    def add(self, x: float, step: int) -> None:
        self.values.append(x)
        self.last_step = step

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
        self._clock = 0  # samples recorded so far: orders measurements by age
        self._probes: dict[int, tuple[int, int]] = {}  # bucket -> (k being probed, steps left)
        self._probed: dict[int, int] = {}  # bucket -> k whose probe just ended
        self._current: dict[int, int] = {}  # bucket -> its chosen k outside probes
        # bucket -> (steps left until it explores, current wait, best k when the wait was set)
        self._explore: dict[int, tuple[int, int, int]] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def record_step(self, batch_size: int, drafts: int, seconds: float, tokens_gained: float) -> None:
        """The forward (and verification) of a pure decode step of `batch_size` requests that
        verified `drafts` drafts each."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        self._clock += 1
        self.step_seconds.setdefault((self.bucket(batch_size), drafts), Samples()).add(seconds, self._clock)
        if drafts:
            self.tokens_per_step.setdefault(drafts, Samples()).add(tokens_gained / batch_size, self._clock)

    def record_drafting(self, batch_size: int, drafts: int, seconds: float) -> None:
        """Drafting `drafts` tokens for each of `batch_size` decoding requests took `seconds`."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        self._clock += 1
        self.draft_seconds.setdefault((self.bucket(batch_size), drafts), Samples()).add(seconds, self._clock)

    def _rate(self, bucket: int, k: int) -> float | None:
        """Tokens per second with k drafts in this bucket; None until measured."""
        step = self.step_seconds.get((bucket, k))
        gain = self.tokens_per_step.get(k).estimate if k in self.tokens_per_step else 1.0 if k == 0 else None
        draft = self.draft_seconds.get((bucket, k)) if k else None
        if step is None or gain is None or (k and draft is None):
            return None
        return gain / (step.estimate + (draft.estimate if draft is not None else 0.0))

    def _age(self, bucket: int, k: int) -> int:
        """When k was last measured in this bucket (its verification or its drafting, the older)."""
        step = self.step_seconds[(bucket, k)].last_step
        return min(step, self.draft_seconds[(bucket, k)].last_step) if k else step

    def choose(self, batch_size: int, measurable: bool = True) -> int:
        """Drafts per request for the next step of a batch of `batch_size` decoding requests.

        `measurable` False: the next step will not be recorded (prompts are still being prefilled
        alongside), so nothing is explored in it; it gets the settled choice of this batch size or
        of the nearest one measured, else k = 0."""
        if self.max_drafts == 0 or batch_size == 0:
            return 0
        b = self.bucket(batch_size)
        if not measurable:
            return self._settled(b)
        if b in self._probes:
            return self._continue_probe(b)
        rates: dict[int, float] = {}
        for k in range(self.max_drafts + 1):
            rate = self._rate(b, k)
            if rate is None:
                # Measure k only while each longer draft has paid so far: a k that loses to k - 1
                # is not worth one more costly probe to learn that k + 1 loses too.
                if not rates or self._best(rates) == k - 1:
                    return self._start_probe(b, k)
                break
            rates[k] = rate
        best = self._best(rates)
        probed, self._probed = self._probed.pop(b, None), self._probed
        if best != self._current.get(b, best) and best != probed:
            return self._start_probe(b, best)  # switch only on fresh numbers, not on stale ones
        self._current[b] = best
        if len(rates) > 1 and self._explore_due(b, best):
            # k = 0 is the safe choice: while speculating, explorations re-check it (the other
            # lengths keep their last measurements).
            if best:
                return self._start_probe(b, 0)
            return self._start_probe(b, min((k for k in rates if k != best), key=lambda k: self._age(b, k)))
        return best

    @staticmethod
    def _best(rates: dict[int, float]) -> int:
        """The fastest k; k = 0 unless speculation beats it by MARGIN."""
        best = max(rates, key=rates.__getitem__)
        return best if rates[best] >= rates[0] * (1 + MARGIN) else 0

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

    def _explore_due(self, bucket: int, best: int) -> bool:
        left, wait, best_then = self._explore.get(bucket, (self.explore_every, self.explore_every, best))
        if best != best_then:  # the choice changed (noise can do that): check the old one again soon
            wait = self.explore_every
            left = min(left, 2 * PROBE_STEPS)
        if left > 1:
            self._explore[bucket] = (left - 1, wait, best)
            return False
        wait = min(2 * wait, MAX_EXPLORE_EVERY)
        self._explore[bucket] = (wait, wait, best)
        return True
