"""The orchestrator's policy core: pause model, Continuum TTL, program graphs, next-use prediction, policies.

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
from orchestrator._policy import (
    POLICIES,
    POLICY_OPTIONS,
    ContinuumPolicy,
    Event,
    HintFlowPolicy,
    HintPolicy,
    KVFlowPolicy,
    PolicySpec,
    ProgramEnded,
    ThunderAgentPolicy,
    Tick,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
    VLLMDefaultPolicy,
    get_policy,
    parse_policy_spec,
)
from orchestrator._router import (
    ROUTING_POLICIES,
    NodeView,
    NoNodeAvailable,
    RouteDecision,
    Router,
    RouteRequest,
    RoutingPolicy,
    default_prefill_s,
    get_routing_policy,
)
from orchestrator._ttl import ContinuumTTL, continuum_tau

__all__ = [
    "POLICIES",
    "POLICY_OPTIONS",
    "ROUTING_POLICIES",
    "ContinuumPolicy",
    "ContinuumTTL",
    "EmpiricalDistribution",
    "Event",
    "ExponentialDistribution",
    "HintFlowPolicy",
    "HintPolicy",
    "JoinKind",
    "KVFlowPolicy",
    "NoNodeAvailable",
    "NodeView",
    "PauseDistribution",
    "PauseModel",
    "PolicySpec",
    "ProgramEnded",
    "ProgramGraph",
    "ProgramState",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "ThunderAgentPolicy",
    "Tick",
    "ToolEnded",
    "ToolStarted",
    "TurnEnded",
    "TurnStarted",
    "VLLMDefaultPolicy",
    "continuum_tau",
    "default_prefill_s",
    "get_policy",
    "get_routing_policy",
    "parse_policy_spec",
    "pause_tool",
    "shared_prefix_steps",
    "steps_to_execution",
]
