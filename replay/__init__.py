"""Trace-driven replay: agent workload traces, readers, generators and the policy comparison harness."""

from replay._generators import (
    GENERATORS,
    HumanInLoop,
    MultiAgent,
    SweAgent,
    WorkloadGenerator,
    capped_lognormal_moments,
    generate,
    lognormal_params,
    poisson_arrivals,
    with_poisson_arrivals,
)
from replay._policies import REPLAY_CONFIGS, ReplayConfig, get_replay_config, parse_policy_list
from replay._readers import (
    MOONCAKE_BLOCK_SIZE,
    dump_jsonl,
    load_jsonl,
    program_from_dict,
    program_to_dict,
    read_mooncake,
    read_trie,
    read_workload,
)
from replay._trace import JOIN_KINDS, JoinKind, Program, Session, TraceError, Turn, scale_tokens

__all__ = [
    "GENERATORS",
    "JOIN_KINDS",
    "MOONCAKE_BLOCK_SIZE",
    "REPLAY_CONFIGS",
    "REQUIRED_KEYS",
    "WORKLOAD_DEFAULTS",
    "HumanInLoop",
    "JoinKind",
    "MultiAgent",
    "Program",
    "ReplayConfig",
    "ReplaySetup",
    "Session",
    "SimResult",
    "Simulation",
    "SweAgent",
    "TraceError",
    "Turn",
    "WorkloadGenerator",
    "capped_lognormal_moments",
    "dump_jsonl",
    "estimate_live_context_tokens",
    "generate",
    "get_replay_config",
    "load_jsonl",
    "lognormal_params",
    "metrics",
    "parse_policy_list",
    "poisson_arrivals",
    "program_from_dict",
    "program_to_dict",
    "read_mooncake",
    "read_trie",
    "read_workload",
    "render_table",
    "replay_command",
    "report_json",
    "run_replay",
    "scale_tokens",
    "with_poisson_arrivals",
    "write_plots",
]


# The harness (engine schedulers, cost models, plots) loads on first use, so that importing the trace
# format, or starting the `hintflow` command line, does not pay for it.
_LAZY = {
    **dict.fromkeys(
        ["REQUIRED_KEYS", "metrics", "render_table", "report_json", "write_plots"], "replay._report"
    ),
    **dict.fromkeys(
        ["WORKLOAD_DEFAULTS", "ReplaySetup", "estimate_live_context_tokens", "run_replay"], "replay._setup"
    ),
    **dict.fromkeys(["SimResult", "Simulation"], "replay._sim"),
}


def __getattr__(name: str) -> object:
    """``replay_command`` imports click only when asked for (the library API does not need it)."""
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    if name == "replay_command":
        from replay._cli import replay_command

        return replay_command
    raise AttributeError(f"module 'replay' has no attribute {name!r}")
