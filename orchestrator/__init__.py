"""The orchestrator's policy core: pause model, Continuum TTL, program graphs and next-use prediction.

Plain Python with no Temporal, gRPC, torch or engine_adapter import, so the same objects run live (from
the Temporal interceptor) and in trace-driven replay on virtual time.
"""

from orchestrator._graph import (
    JoinKind,
    ProgramGraph,
    ProgramState,
    pause_tool,
    shared_prefix_steps,
    steps_to_execution,
)
from orchestrator._pause_model import (
    EmpiricalDistribution,
    ExponentialDistribution,
    PauseDistribution,
    PauseModel,
)
from orchestrator._ttl import ContinuumTTL, continuum_tau

__all__ = [
    "ContinuumTTL",
    "EmpiricalDistribution",
    "ExponentialDistribution",
    "JoinKind",
    "PauseDistribution",
    "PauseModel",
    "ProgramGraph",
    "ProgramState",
    "continuum_tau",
    "pause_tool",
    "shared_prefix_steps",
    "steps_to_execution",
]
