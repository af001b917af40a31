"""Pure predictors that both sides of hintflow use: the pause model, Continuum's TTL cost model, what a
host tier gives back, and the two node readings that price a pin where there is none (prefill share of
step time, what the device keeps of unpinned contexts).

The orchestrator's policies and the vLLM node's engine-side hint inference
(``engine_adapter.vllm_backend``) decide pins from the same two objects, so they live here, in a package
that imports nothing else of ours (numpy only): an engine node runs without the orchestrator. See
docs/architecture.md, "Which package may import which".
"""

from predictors._host_hit import HOST_HIT_DECAY, HostHitShare
from predictors._lost_wait import LostContextWait
from predictors._node_signals import PREFILL_SHARE_DECAY, PrefillShare, UnpinnedSurvival
from predictors._pause_model import (
    EmpiricalDistribution,
    ExponentialDistribution,
    PauseDistribution,
    PauseModel,
)
from predictors._ttl import DEFAULT_RENEW_QUANTILE, ContinuumTTL, HostTierTTL, continuum_tau

__all__ = [
    "DEFAULT_RENEW_QUANTILE",
    "HOST_HIT_DECAY",
    "PREFILL_SHARE_DECAY",
    "ContinuumTTL",
    "EmpiricalDistribution",
    "ExponentialDistribution",
    "HostHitShare",
    "HostTierTTL",
    "LostContextWait",
    "PauseDistribution",
    "PauseModel",
    "PrefillShare",
    "UnpinnedSurvival",
    "continuum_tau",
]
