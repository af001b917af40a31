"""PrefillReload learned from the engine's own answers, shared by the live runtime and the replay."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

__all__ = ["PrefillEstimator"]


class PrefillEstimator:
    """PrefillReload(ctx) learned from the node's own answers: seconds per recomputed token, measured.

    Each finished call gives (tokens prefilled, ttft - queue wait); the estimate is the ratio of their sums
    over the last ``window`` calls with at least ``min_tokens`` prefilled, which is what a context re-prefill
    costs on this node under its current load (a profiled cost model knows the idle machine only).  Until
    ``min_samples`` calls were seen, ``prior`` answers (the engine's profiled cost model when given).
    """

    def __init__(
        self,
        prior: Callable[[int], float] | None = None,
        *,
        window: int = 64,
        min_samples: int = 4,
        min_tokens: int = 32,
    ) -> None:
        self.prior = prior if prior is not None else (lambda n: 1e-4 * n)
        self.min_samples, self.min_tokens = min_samples, min_tokens
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_prefilled: int, prefill_s: float) -> None:
        if num_prefilled >= self.min_tokens and prefill_s >= 0.0 and math.isfinite(prefill_s):
            self._samples.append((num_prefilled, prefill_s))

    @property
    def s_per_token(self) -> float | None:
        if len(self._samples) < self.min_samples:
            return None
        return sum(t for _, t in self._samples) / sum(n for n, _ in self._samples)

    def reload_s(self, context_tokens: int) -> float:
        rate = self.s_per_token
        return float(self.prior(context_tokens)) if rate is None else rate * context_tokens
