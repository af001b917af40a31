"""How long turns whose context was not kept waited to be admitted: a sliding mean.

Continuum's T (``ContinuumTTL.queue_delay_s``, the queueing a pin saves an evicted turn) is this measure.
(Program admission's ``auto`` hold followed it too until it proved to be the 1 s hold on the real node:
``engine_adapter/_program_admission.py``.)
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["LostContextWait"]


class LostContextWait:
    """The mean of the last ``window`` waits observed (0 before the first)."""

    def __init__(self, window: int = 100) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._waits_s: deque[float] = deque(maxlen=window)

    def observe(self, wait_s: float) -> None:
        if not (wait_s >= 0.0 and math.isfinite(wait_s)):
            raise ValueError(f"a wait must be finite and >= 0 seconds, got {wait_s}")
        self._waits_s.append(float(wait_s))

    def copy(self) -> LostContextWait:
        out = LostContextWait(self._waits_s.maxlen or 1)
        out._waits_s.extend(self._waits_s)
        return out

    @property
    def num_waits(self) -> int:
        return len(self._waits_s)

    @property
    def mean_s(self) -> float:
        return math.fsum(self._waits_s) / len(self._waits_s) if self._waits_s else 0.0
