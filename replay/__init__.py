"""Trace-driven replay: agent workload traces, readers, generators and the policy comparison harness."""

from typing import TYPE_CHECKING

from replay._generator_registry import GENERATORS, generate
from replay._generators import (
    HumanInLoop,
    MultiAgent,
    SweAgent,
    WorkloadGenerator,
    capped_lognormal_moments,
    lognormal_params,
    poisson_arrivals,
    with_poisson_arrivals,
)
from replay._policies import (
    REPLAY_CONFIGS,
    SCHEDULER_OPTIONS,
    ReplayConfig,
    get_replay_config,
    parse_policy_list,
    parse_variant,
)
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
from replay._skewed import SkewedAgents
from replay._trace import JOIN_KINDS, JoinKind, Program, Session, TraceError, Turn, scale_tokens

if TYPE_CHECKING:
    from replay._cli import replay_command, writable_parent
    from replay._nodes import NodeSpec
    from replay._plots import write_plots
    from replay._report import (
        ANALYSIS_ROWS,
        REQUIRED_KEYS,
        bound_note,
        metrics,
        render_table,
        report_json,
    )
    from replay._setup import WORKLOAD_DEFAULTS, ReplaySetup, estimate_live_context_tokens, run_replay
    from replay._sim import SimResult, Simulation
    from replay._vllm_backend import parse_vllm_variant
    from replay._vllm_bench import MODE_ENV, vllm_counters
    from replay._vllm_bench import main as vllm_bench_main

__all__ = [
    "ANALYSIS_ROWS",
    "GENERATORS",
    "JOIN_KINDS",
    "MODE_ENV",
    "MOONCAKE_BLOCK_SIZE",
    "REPLAY_CONFIGS",
    "REQUIRED_KEYS",
    "SCHEDULER_OPTIONS",
    "WORKLOAD_DEFAULTS",
    "HumanInLoop",
    "JoinKind",
    "MultiAgent",
    "NodeSpec",
    "Program",
    "ReplayConfig",
    "ReplaySetup",
    "Session",
    "SimResult",
    "Simulation",
    "SkewedAgents",
    "SweAgent",
    "TraceError",
    "Turn",
    "WorkloadGenerator",
    "bound_note",
    "capped_lognormal_moments",
    "dump_jsonl",
    "estimate_live_context_tokens",
    "generate",
    "get_replay_config",
    "load_jsonl",
    "lognormal_params",
    "metrics",
    "parse_policy_list",
    "parse_variant",
    "parse_vllm_variant",
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
    "vllm_bench_main",
    "vllm_counters",
    "with_poisson_arrivals",
    "writable_parent",
    "write_plots",
]


# The harness (engine schedulers, cost models, plots, the vLLM benchmark) loads on first use, so that
# importing the trace format, or starting the `hintflow` command line, does not pay for it.
# name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    **{n: ("replay._report", n) for n in ("ANALYSIS_ROWS", "REQUIRED_KEYS", "bound_note", "metrics", "render_table", "report_json")},
    "write_plots": ("replay._plots", "write_plots"),
    **{n: ("replay._setup", n) for n in ("WORKLOAD_DEFAULTS", "ReplaySetup", "estimate_live_context_tokens", "run_replay")},
    **{n: ("replay._sim", n) for n in ("SimResult", "Simulation")},
    "NodeSpec": ("replay._nodes", "NodeSpec"),
    **{n: ("replay._cli", n) for n in ("replay_command", "writable_parent")},
    "vllm_bench_main": ("replay._vllm_bench", "main"),
    "MODE_ENV": ("replay._vllm_bench", "MODE_ENV"),
    "vllm_counters": ("replay._vllm_bench", "vllm_counters"),
    "parse_vllm_variant": ("replay._vllm_backend", "parse_vllm_variant"),
}


def __getattr__(name: str) -> object:
    """Import a lazy export on first use (click, the engine schedulers and vLLM's launcher only when asked)."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(where[0]), where[1])  # (not cached: see engine_adapter's face)
