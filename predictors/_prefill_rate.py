"""What a re-prefill costs on this node: seconds per token of its prefill-sized steps, measured.

Why one estimator, reported: a pin is worth what re-prefilling the context would cost when its turn comes
back, so both the node's own inference and the orchestrator's policies price pins by it. The node is the
one that sees its steps; the orchestrator sees only answers (a turn's first token less its queue wait, and
the vLLM harness not even the queue wait). So the node measures it here and reports it in
``CacheState.prefill_s_per_token``, and the orchestrator's control core prices by the nodes' figure until
it has measured its own (``orchestrator.PrefillEstimator``).
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

    def reported(self) -> float:
        """What the node reports: the figure once a step was seen (or fixed), else 0 (not known yet)."""
        return self.s_per_token if (self.num_observed or not self.measured) else 0.0
