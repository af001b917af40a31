"""The synthetic workloads by name: ``-w NAME`` on the command line, ``replay.generate(NAME, ...)`` in Python."""

from __future__ import annotations

import dataclasses
from typing import Any

from replay._generators import HumanInLoop, MultiAgent, SweAgent, WorkloadGenerator
from replay._skewed import SkewedAgents
from replay._trace import Program

__all__ = ["GENERATORS", "generate"]

GENERATORS: dict[str, type[WorkloadGenerator]] = {
    g.name: g for g in (SweAgent, MultiAgent, HumanInLoop, SkewedAgents)
}


def generate(
    name: str,
    *,
    seed: int,
    num_programs: int | None = None,
    rate: float | None = None,
    scale: float = 1.0,
    **params: Any,
) -> list[Program]:
    """Programs from the generator ``name`` with its defaults, overridden by the arguments given."""
    if name not in GENERATORS:
        raise ValueError(f"unknown generator {name!r}; known: {sorted(GENERATORS)}")
    cls = GENERATORS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{name}: unknown parameters {unknown}; known: {sorted(known)}")
    if num_programs is not None:
        params["num_programs"] = num_programs
    if rate is not None:
        params["rate"] = rate
    return cls(**params).generate(seed=seed, scale=scale)
