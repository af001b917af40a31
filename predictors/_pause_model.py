"""How long a tool pause lasts, and how much of it is left once it has run for a while.

Tool pauses are short on average with a very long tail (the slowest 10% of ``cd`` calls were 94% of
``cd`` time), so a mean is a poor predictor: what the policies need is the *remaining* pause given the
time already elapsed, E[T - t | T > t], and the ECDF Continuum's TTL rule maximises over.  Both come
from an empirical distribution of recent samples per tool.

Cold start follows Continuum: a tool's own samples once it has ``min_samples`` of them, else the
global distribution over all tools once *that* has enough, else a default Exp(mean) whose closed forms
are exact (memoryless: the remaining pause is always the mean).

Extrapolation past the largest sample (:meth:`EmpiricalDistribution.conditional_remaining`): with no
sample above t the data say nothing, so we assume a Pareto-like tail fitted on the top decile: with
``u`` the 0.9 quantile and ``e_top`` the mean excess of the samples above ``u``, the remaining pause at
``t`` is ``e_top * t / u`` (a Pareto tail's mean excess grows in proportion to t).  For light tails
this overestimates, which errs toward "not needed soon": a stuck tool loses its pin and ranks early
for eviction, the safe direction for memory.  Degenerate data (u == 0 or no spread above u) fall back
to ``t`` itself, the recency rule the engine uses for unhinted contexts.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from typing import Literal, Protocol, runtime_checkable

import numpy as np

__all__ = ["EmpiricalDistribution", "ExponentialDistribution", "PauseDistribution", "PauseModel"]

DistributionSource = Literal["tool", "global", "default"]


@runtime_checkable
class PauseDistribution(Protocol):
    """What the TTL rule and next-use predictors need from a pause-length distribution (seconds)."""

    @property
    def mean(self) -> float: ...

    @property
    def num_samples(self) -> int: ...

    def ecdf(self, t_s: float) -> float: ...

    def ecdf_array(self, ts_s: np.ndarray) -> np.ndarray: ...

    def survival(self, t_s: float) -> float: ...

    def quantile(self, q: float) -> float: ...

    def conditional_remaining(self, elapsed_s: float) -> float: ...

    def conditional(self, elapsed_s: float) -> PauseDistribution: ...

    def support(self) -> np.ndarray: ...


def _check_q(q: float) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must lie in [0, 1], got {q}")


class ExponentialDistribution:
    """Exp(mean): the cold-start default, with exact closed forms.

    ``support()`` is a grid of ``num_grid`` quantiles at levels i/(num_grid+1), standing in for S[f]
    so Continuum's discrete argmax lands within a grid step of the continuous optimum.
    """

    def __init__(self, mean_s: float, *, num_grid: int = 1000) -> None:
        if not (mean_s > 0.0 and math.isfinite(mean_s)):
            raise ValueError(f"mean_s must be positive and finite, got {mean_s}")
        if num_grid < 1:
            raise ValueError(f"num_grid must be >= 1, got {num_grid}")
        self._mean_s = float(mean_s)
        levels = np.arange(1, num_grid + 1, dtype=float) / (num_grid + 1)
        self._grid = -self._mean_s * np.log1p(-levels)
        self._grid.setflags(write=False)

    @property
    def mean(self) -> float:
        return self._mean_s

    @property
    def num_samples(self) -> int:
        """No observations back this distribution: it is an assumption."""
        return 0

    def ecdf(self, t_s: float) -> float:
        return 0.0 if t_s <= 0.0 else -math.expm1(-t_s / self._mean_s)

    def ecdf_array(self, ts_s: np.ndarray) -> np.ndarray:
        ts = np.asarray(ts_s, dtype=float)
        return np.where(ts <= 0.0, 0.0, -np.expm1(-np.maximum(ts, 0.0) / self._mean_s))

    def survival(self, t_s: float) -> float:
        return 1.0 - self.ecdf(t_s)

    def quantile(self, q: float) -> float:
        _check_q(q)
        return math.inf if q == 1.0 else -self._mean_s * math.log1p(-q)

    def conditional_remaining(self, elapsed_s: float) -> float:
        """Memoryless: whatever has elapsed, the mean is still ahead."""
        return self._mean_s

    def conditional(self, elapsed_s: float) -> ExponentialDistribution:
        return self

    def support(self) -> np.ndarray:
        return self._grid

    def __repr__(self) -> str:
        return f"ExponentialDistribution(mean_s={self._mean_s:g})"


class EmpiricalDistribution:
    """A bounded reservoir of the most recent samples, kept sorted for O(log n) ECDF look-ups.

    Recent rather than uniform sampling, so a tool whose latency shifts (a slower backend, a bigger
    repository) is tracked; ``capacity`` bounds memory and the cost of the sorted insert.
    """

    def __init__(self, samples: Iterable[float] = (), *, capacity: int = 2000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        for x in samples:
            self.observe(x)

    def observe(self, x_s: float) -> None:
        x = float(x_s)
        if not (x >= 0.0 and math.isfinite(x)):
            raise ValueError(f"a duration must be finite and >= 0, got {x_s}")
        if len(self._fifo) == self._capacity:
            oldest = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._fifo.append(x)
        bisect.insort(self._sorted, x)
        self._arrays = None

    def _sorted_and_suffix(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted samples and suffix sums (``suffix[i] = sum(arr[i:])``), rebuilt lazily after changes."""
        if self._arrays is None:
            if not self._sorted:
                raise ValueError("empty distribution: no samples observed")
            arr = np.asarray(self._sorted, dtype=float)
            suffix = np.concatenate([np.cumsum(arr[::-1])[::-1], [0.0]])
            arr.setflags(write=False)
            self._arrays = (arr, suffix)
        return self._arrays

    @property
    def num_samples(self) -> int:
        return len(self._sorted)

    @property
    def mean(self) -> float:
        arr, suffix = self._sorted_and_suffix()
        return float(suffix[0]) / len(arr)

    def ecdf(self, t_s: float) -> float:
        """Fraction of samples <= t (right-continuous)."""
        n = self.num_samples
        if n == 0:
            raise ValueError("empty distribution: no samples observed")
        return bisect.bisect_right(self._sorted, t_s) / n

    def ecdf_array(self, ts_s: np.ndarray) -> np.ndarray:
        arr, _ = self._sorted_and_suffix()
        return np.searchsorted(arr, np.asarray(ts_s, dtype=float), side="right") / len(arr)

    def survival(self, t_s: float) -> float:
        return 1.0 - self.ecdf(t_s)

    def quantile(self, q: float) -> float:
        """The smallest sample x with ECDF(x) >= q (the generalised inverse; q = 0 gives the minimum)."""
        _check_q(q)
        n = self.num_samples
        if n == 0:
            raise ValueError("empty distribution: no samples observed")
        return self._sorted[max(math.ceil(q * n) - 1, 0)]

    def _tail_excess(self, elapsed_s: float) -> float:
        """Mean excess past the largest sample (see the module docstring for why this shape)."""
        arr, _ = self._sorted_and_suffix()
        u = self.quantile(0.9)
        above = arr[arr > u]
        e_top = float(np.mean(above - u)) if above.size else 0.0
        if u > 0.0 and e_top > 0.0:
            return e_top * max(elapsed_s, u) / u
        return max(elapsed_s, 0.0)

    def conditional_remaining(self, elapsed_s: float) -> float:
        """E[T - t | T > t] from the samples above t; past the largest sample, extrapolated."""
        arr, suffix = self._sorted_and_suffix()
        i = int(np.searchsorted(arr, elapsed_s, side="right"))
        k = len(arr) - i
        if k > 0:
            return float(suffix[i]) / k - elapsed_s
        return self._tail_excess(elapsed_s)

    def conditional(self, elapsed_s: float) -> PauseDistribution:
        """The distribution of T - t given T > t: the samples above t, shifted down by t.

        Past the largest sample there is nothing to shift, so it is an exponential with the
        extrapolated mean excess (or "ends now" when that is 0).
        """
        arr, _ = self._sorted_and_suffix()
        rest = arr[np.searchsorted(arr, elapsed_s, side="right") :] - elapsed_s
        if rest.size:
            out = EmpiricalDistribution(capacity=int(rest.size))
            out._sorted = rest.tolist()
            out._fifo = deque(out._sorted)
            return out
        excess = self._tail_excess(elapsed_s)
        return ExponentialDistribution(excess) if excess > 0.0 else EmpiricalDistribution([0.0])

    def support(self) -> np.ndarray:
        """The observed samples, sorted (read-only): Continuum's candidate TTLs S[f]."""
        return self._sorted_and_suffix()[0]

    def __repr__(self) -> str:
        return f"EmpiricalDistribution(num_samples={self.num_samples}, capacity={self._capacity})"


class PauseModel:
    """Per-tool pause distributions with Continuum's cold-start fallback (tool -> global -> default)."""

    def __init__(
        self,
        *,
        min_samples: int = 100,
        default_mean_s: float = 1.0,
        capacity: int = 2000,
        global_capacity: int | None = None,
        num_grid: int = 1000,
    ) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self._capacity = capacity
        self._tools: dict[str, EmpiricalDistribution] = {}
        self._global = EmpiricalDistribution(capacity=global_capacity or capacity)
        self._default = ExponentialDistribution(default_mean_s, num_grid=num_grid)

    def observe(self, tool: str, duration_s: float) -> None:
        """Record one finished pause of ``tool`` in its own reservoir and the global one."""
        dist = self._tools.get(tool)
        if dist is None:
            dist = self._tools[tool] = EmpiricalDistribution(capacity=self._capacity)
        dist.observe(duration_s)
        self._global.observe(duration_s)

    def tools(self) -> list[str]:
        return sorted(self._tools)

    def num_samples(self, tool: str) -> int:
        dist = self._tools.get(tool)
        return 0 if dist is None else dist.num_samples

    def source(self, tool: str) -> DistributionSource:
        """Which distribution :meth:`distribution` uses for ``tool`` right now."""
        if self.num_samples(tool) >= self.min_samples:
            return "tool"
        if self._global.num_samples >= self.min_samples:
            return "global"
        return "default"

    def distribution(self, tool: str) -> PauseDistribution:
        src = self.source(tool)
        if src == "tool":
            return self._tools[tool]
        return self._global if src == "global" else self._default

    def expected_remaining(self, tool: str, elapsed_s: float) -> float:
        """Predicted seconds until a pause of ``tool`` that has run ``elapsed_s`` ends."""
        return self.distribution(tool).conditional_remaining(elapsed_s)

    def samples(self, tool: str) -> np.ndarray:
        """Continuum's S[f]: observed durations, or the default's quantile grid while cold."""
        return self.distribution(tool).support()
