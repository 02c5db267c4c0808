"""SpecPolicy: how many MTP drafts to propose this step, from measured acceptance and step costs.

Expected tokens per request per step with k drafts and per-draft acceptance a: 1 + a + ... + a^k.
Cost of a step: the main model over B * (1 + k) tokens plus k MTP steps over B tokens; both are
measured online as lines (fixed cost + cost per token). k maximises tokens per second, so when
verification tokens are not nearly free (large batches, compute-bound) the answer is k = 0.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class CostModel:
    """Least-squares line seconds = a + b * tokens over recent observations."""

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))

    def predict(self, tokens: int) -> float | None:
        xs = np.array([s[0] for s in self.samples], dtype=np.float64)
        if len(xs) < 4 or np.ptp(xs) == 0:
            return None
        ys = np.array([s[1] for s in self.samples], dtype=np.float64)
        slope, intercept = np.polyfit(xs, ys, 1)
        return max(float(intercept + slope * tokens), 1e-6)


class SpecPolicy:
    def __init__(self, max_drafts: int, prior_acceptance: float = 0.6, explore_every: int = 16):
        if max_drafts < 0:
            raise ValueError("max_drafts: must be >= 0")
        self.max_drafts = max_drafts
        self.main_cost = CostModel()
        self.mtp_cost = CostModel()
        self.drafted = 0
        self.accepted = 0
        self.prior = prior_acceptance
        self.explore_every = explore_every
        self._steps = 0

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance rate, smoothed towards the prior while there is little data."""
        return (self.accepted + 8 * self.prior) / (self.drafted + 8)

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of a batch of `batch_size` decoding requests."""
        if self.max_drafts == 0 or batch_size == 0:
            return 0
        self._steps += 1
        costs = [self._step_cost(batch_size, k) for k in range(self.max_drafts + 1)]
        if any(c is None for c in costs):
            # Not enough timing yet: vary k so both cost lines get points at different token counts.
            return self._steps % (self.max_drafts + 1)
        a = self.acceptance
        rates = [sum(a**i for i in range(k + 1)) / c for k, c in enumerate(costs)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if best == 0 and self._steps % self.explore_every == 0:
            return 1  # keep measuring: load and acceptance change
        return best

    def _step_cost(self, batch_size: int, k: int) -> float | None:
        main = self.main_cost.predict(batch_size * (k + 1))
        if k == 0:
            return main
        mtp = self.mtp_cost.predict(batch_size)
        return None if main is None or mtp is None else main + k * mtp
