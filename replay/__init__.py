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
    "HumanInLoop",
    "JoinKind",
    "MultiAgent",
    "Program",
    "Session",
    "SweAgent",
    "TraceError",
    "Turn",
    "WorkloadGenerator",
    "capped_lognormal_moments",
    "dump_jsonl",
    "generate",
    "load_jsonl",
    "lognormal_params",
    "poisson_arrivals",
    "program_from_dict",
    "program_to_dict",
    "read_mooncake",
    "read_trie",
    "read_workload",
    "scale_tokens",
    "with_poisson_arrivals",
]
