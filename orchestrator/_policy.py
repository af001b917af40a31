"""The event-to-hints layer: program events in, validated hints out (see docs/architecture.md, "Hint vocabulary").

A policy is a small object chosen by name from :data:`POLICIES`; the baselines (``vllm-default``,
``continuum``, ``kvflow``, ``thunderagent``) are policies too, so comparisons run on one code path.
Every time in a hint is a duration measured at the event's ``now_s`` (``ttl_s``, ``next_use_s``,
``program_age_s``); the node turns them into deadlines on its own clock.

Every hint is built through the pydantic models in :mod:`hints` inside :meth:`_BasePolicy._safe`, so a
policy bug (NaN, a negative duration, a ``prefill_reload`` that returns garbage) drops that hint with a
logged warning and a count in ``num_invalid_hints`` instead of sending it or raising into the caller.

Plain Python: no Temporal, gRPC, torch or engine_adapter import (it runs live and in replay).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestrator._baselines import ContinuumPolicy, KVFlowPolicy, ThunderAgentPolicy, VLLMDefaultPolicy
from orchestrator._events import (
    Event,
    HintPolicy,
    ProgramEnded,
    Tick,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
)
from orchestrator._hintflow_policy import HintFlowPolicy
from orchestrator._policy_spec import POLICY_OPTIONS, PolicySpec, parse_policy_spec

__all__ = [
    "POLICIES",
    "POLICY_OPTIONS",
    "ContinuumPolicy",
    "Event",
    "HintFlowPolicy",
    "HintPolicy",
    "KVFlowPolicy",
    "PolicySpec",
    "ProgramEnded",
    "ThunderAgentPolicy",
    "Tick",
    "ToolEnded",
    "ToolStarted",
    "TurnEnded",
    "TurnStarted",
    "VLLMDefaultPolicy",
    "get_policy",
    "parse_policy_spec",
]


POLICIES: dict[str, Callable[..., HintPolicy]] = {
    VLLMDefaultPolicy.name: VLLMDefaultPolicy,
    ContinuumPolicy.name: ContinuumPolicy,
    KVFlowPolicy.name: KVFlowPolicy,
    ThunderAgentPolicy.name: ThunderAgentPolicy,
    HintFlowPolicy.name: HintFlowPolicy,
}
"""Registered policies by name; each factory takes ``pause_model=`` and ``prefill_reload=``."""


def get_policy(name: str, **kw: Any) -> HintPolicy:
    """Build the policy registered as ``name``, or a spec ``NAME:KEY=VALUE,...`` (``_policy_spec``: its
    options win over ``kw``); ValueError listing the known names (or options) otherwise."""
    spec = parse_policy_spec(name, POLICIES)
    policy: HintPolicy = spec.build(POLICIES, **kw)
    return policy
