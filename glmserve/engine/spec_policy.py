"""SpecPolicy: how many MTP drafts to propose next step, chosen from what each choice really gave.

For each batch-size bucket (powers of two) and each k in 0..max_drafts it keeps running averages of
the wall time of a pure decode step's forward that verified k drafts, of the time drafting k took
(MTP forwards, catching up deferred positions included), and of the tokens a request gained per step.
A step's forward verifies the drafts chosen one step earlier, while its drafting serves the next
step, so the two are recorded under their own k. It picks the k with the most tokens per second
(k > 0 only when it beats k = 0 by a margin). Everything the engine spends on speculation is in the
measured times, so when speculation does not pay (large batches, low acceptance) k = 0 wins. A
bucket tries k + 1 only once k has beaten every shorter choice. Now and then it re-measures a
neighbour of the best k, since load and acceptance drift: first after `explore_every` steps in the
bucket, and each time that leaves the best k unchanged the wait doubles (up to `MAX_EXPLORE_EVERY`),
so a bucket where speculation keeps losing (large batches) rarely pays for trying it again.
"""

from __future__ import annotations

SMOOTHING = 0.2  # weight of a new observation in the running averages
# Speculation must beat k = 0 by this fraction: step times are noisy, and a tie is a loss once the
# cost of exploring is counted.
MARGIN = 0.03
MAX_EXPLORE_EVERY = 512


class RunningMean:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * x


class SpecPolicy:
    def __init__(self, max_drafts: int, explore_every: int = 24):
        if max_drafts < 0:
            raise ValueError("max_drafts: must be >= 0")
        self.max_drafts = max_drafts
        self.explore_every = explore_every
        self.step_seconds: dict[tuple[int, int], RunningMean] = {}
        self.draft_seconds: dict[tuple[int, int], RunningMean] = {}
        self.tokens_per_step: dict[int, RunningMean] = {0: RunningMean()}
        self.tokens_per_step[0].add(1.0)
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
        self.step_seconds.setdefault((self.bucket(batch_size), drafts), RunningMean()).add(seconds)
        if drafts:
            self.tokens_per_step.setdefault(drafts, RunningMean()).add(tokens_gained / batch_size)

    def record_drafting(self, batch_size: int, drafts: int, seconds: float) -> None:
        """Drafting `drafts` tokens for each of `batch_size` decoding requests took `seconds`."""
        if drafts > self.max_drafts or batch_size == 0:
            return
        self.draft_seconds.setdefault((self.bucket(batch_size), drafts), RunningMean()).add(seconds)

    def _rate(self, bucket: int, k: int) -> float | None:
        """Tokens per second with k drafts in this bucket; None until measured."""
        step, gain = self.step_seconds.get((bucket, k)), self.tokens_per_step.get(k)
        draft = self.draft_seconds.get((bucket, k)) if k else None
        if step is None or gain is None or (k and draft is None):
            return None
        return gain.value / (step.value + (draft.value if draft is not None else 0.0))

    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of a batch of `batch_size` decoding requests."""
        if self.max_drafts == 0 or batch_size == 0:
            return 0
        b = self.bucket(batch_size)
        rates: dict[int, float] = {}
        for k in range(self.max_drafts + 1):
            rate = self._rate(b, k)
            if rate is None:
                # Measure k only while each longer draft has paid so far: a k that loses to k - 1
                # is not worth one more costly step to learn that k + 1 loses too.
                if not rates or max(rates, key=rates.__getitem__) == k - 1:
                    return k
                break
            rates[k] = rate
        best = max(rates, key=rates.__getitem__)
        if rates[best] < rates[0] * (1 + MARGIN):
            best = 0
        if self._explore_due(b, best):
            return min(best + 1, self.max_drafts) if best < self.max_drafts else best - 1
        return best

    def _explore_due(self, bucket: int, best: int) -> bool:
        left, wait, best_then = self._explore.get(bucket, (self.explore_every, self.explore_every, best))
        if best != best_then:  # the last exploration (or drift) changed the choice: look again soon
            wait = self.explore_every
            left = min(left, wait)
        if left > 1:
            self._explore[bucket] = (left - 1, wait, best)
            return False
        wait = min(2 * wait, MAX_EXPLORE_EVERY)
        self._explore[bucket] = (wait, wait, best)
        return True
