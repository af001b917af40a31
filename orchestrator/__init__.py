"""The orchestrator's policy core: pause model, Continuum TTL, program graphs, next-use prediction, policies.

Plain Python with no Temporal, gRPC, torch or engine_adapter import, so the same objects run live (from
the Temporal interceptor) and in trace-driven replay on virtual time.
"""

from orchestrator._addressing import hints_by_node
from orchestrator._control import ControlCore, Pause
from orchestrator._graph import (
    JoinKind,
    ProgramGraph,
    ProgramState,
    pause_tool,
    shared_prefix_steps,
    steps_to_execution,
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
from orchestrator._policy_spec import Option, parse_options, parse_value
from orchestrator._prefill import PrefillEstimator
from orchestrator._rebalance import MAX_MOVES_PER_TURN, NodeRoom, QueuedTurn, move_target, take_context_along
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
from orchestrator._thunder import (
    THUNDER_PERIOD_S,
    SessionLoad,
    ThunderAgent,
    ThunderPlan,
    thunder_pause_hints,
)
from orchestrator._tracker import ProgramTracker, role_of
from predictors import (
    ContinuumTTL,
    EmpiricalDistribution,
    ExponentialDistribution,
    HostTierTTL,
    PauseDistribution,
    PauseModel,
    continuum_tau,
)

__all__ = [
    "MAX_MOVES_PER_TURN",
    "POLICIES",
    "POLICY_OPTIONS",
    "ROUTING_POLICIES",
    "THUNDER_PERIOD_S",
    "ContinuumPolicy",
    "ContinuumTTL",
    "ControlCore",
    "EmpiricalDistribution",
    "Event",
    "ExponentialDistribution",
    "HintFlowPolicy",
    "HintPolicy",
    "HostTierTTL",
    "JoinKind",
    "KVFlowPolicy",
    "NoNodeAvailable",
    "NodeRoom",
    "NodeView",
    "Option",
    "Pause",
    "PauseDistribution",
    "PauseModel",
    "PolicySpec",
    "PrefillEstimator",
    "ProgramEnded",
    "ProgramGraph",
    "ProgramState",
    "ProgramTracker",
    "QueuedTurn",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "SessionLoad",
    "ThunderAgent",
    "ThunderAgentPolicy",
    "ThunderPlan",
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
    "hints_by_node",
    "move_target",
    "parse_options",
    "parse_policy_spec",
    "parse_value",
    "pause_tool",
    "role_of",
    "shared_prefix_steps",
    "steps_to_execution",
    "take_context_along",
    "thunder_pause_hints",
]
