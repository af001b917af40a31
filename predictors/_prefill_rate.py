"""What a re-prefill costs on a node: seconds per token of its prefill-sized steps, measured.

A pin is worth what re-prefilling the context would cost when its turn comes back; the vLLM node's own
inference prices its pins by this figure (``HINTFLOW_INFER_RELOAD_S_PER_TOKEN`` fixes it instead). The
orchestrator learns the same cost from the nodes' answers (``orchestrator.PrefillEstimator``). Reporting
the node's figure to the orchestrator (a ``CacheState`` field) was tried and not kept: on a real vLLM it
did not move the pushed policy's figure (docs/benchmarks.md).
"""

from __future__ import annotations

import math

__all__ = ["PREFILL_MIN_STEP_TOKENS", "PrefillRate"]

PREFILL_MIN_STEP_TOKENS = 64
"""The least tokens a step must compute to count: decode-only steps cost per sequence, not per token."""


class PrefillRate:
    """Seconds per computed token of the node's prefill-sized steps: an exponentially weighted mean
    (weight ``weight`` per step) from ``prior``, or ``fixed`` (a profile, as Continuum's fit: then steps
    are not counted)."""

    def __init__(self, prior: float = 1e-4, *, fixed: float | None = None, weight: float = 0.1) -> None:
        for name, v in (("prior", prior), ("fixed", fixed)):
            if v is not None and not (math.isfinite(v) and v > 0.0):
                raise ValueError(f"{name} must be a finite number of seconds per token > 0, got {v}")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.s_per_token = float(fixed if fixed is not None else prior)
        self.measured = fixed is None
        self.weight = weight
        self.num_observed = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """A model step computed ``tokens`` tokens in ``seconds``."""
        if self.measured and tokens >= PREFILL_MIN_STEP_TOKENS and seconds > 0.0 and math.isfinite(seconds):
            self.s_per_token += self.weight * (seconds / tokens - self.s_per_token)
            self.num_observed += 1
