"""What the example agents share: per-turn reports and heavy-tailed pause sampling (workflow-safe)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from temporalio.exceptions import ApplicationError

from workflows._api import LLMResult

__all__ = [
    "ProgramReport",
    "TurnReport",
    "check_input",
    "fixed_prefix",
    "input_problems",
    "lognormal_params",
    "program_rng",
    "sample_pause_s",
]


def input_problems(
    inp: Any,
    *,
    at_least_one: Iterable[str] = (),
    non_negative: Iterable[str] = (),
    positive: Iterable[str] = (),
    non_negative_s: Iterable[str] = (),
) -> list[str]:
    """What is wrong with an example's input: counts are integers (``at_least_one`` >= 1, ``non_negative``
    >= 0), times and rates finite numbers (``positive`` > 0, ``non_negative_s`` >= 0).  Pure Python, so
    ``hintflow run`` checks an input with it before starting anything, and the workflow again."""
    out: list[str] = []
    for name in at_least_one:
        v = getattr(inp, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            out.append(f"{name} must be an integer >= 1, got {v!r}")
    for name in non_negative:
        v = getattr(inp, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            out.append(f"{name} must be an integer >= 0, got {v!r}")
    for names, lowest, bound in ((positive, "> 0", False), (non_negative_s, ">= 0", True)):
        for name in names:
            v = getattr(inp, name)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or (v < 0 if bound else v <= 0):
                out.append(f"{name} must be a finite number {lowest}, got {v!r}")
    return out


def check_input(problems: list[str]) -> None:
    """Fail the workflow, not its task (which Temporal would retry forever), on a bad input."""
    if problems:
        raise ApplicationError("; ".join(problems), type="InvalidInput", non_retryable=True)


@dataclass
class TurnReport:
    session_id: str
    prompt_tokens: int
    history_tokens: int  # tokens this session had already computed before the turn (what could hit)
    cached_tokens: int
    host_hit_tokens: int
    recomputed_tokens: int
    ttft_s: float
    queue_wait_s: float
    latency_s: float
    node: str
    tool: str = ""
    tool_s: float = 0.0


@dataclass
class ProgramReport:
    program_id: str
    example: str
    jct_s: float = 0.0
    turns: list[TurnReport] = field(default_factory=list)

    def add(self, session_id: str, history: int, res: LLMResult) -> TurnReport:
        # Recomputed = history the turn did not find, wherever it ran: a node the router moved the
        # session to never saw that history (and a vLLM node reports none), so the node alone would
        # count its re-prefill as new prompt.
        hits = min(res.num_cached_tokens + res.num_host_hit_tokens, history)
        t = TurnReport(
            session_id,
            res.num_prompt_tokens,
            history,
            res.num_cached_tokens,
            res.num_host_hit_tokens,
            max(res.num_recomputed_tokens, history - hits),
            res.ttft_s,
            res.queue_wait_s,
            res.latency_s,
            res.node,
        )
        self.turns.append(t)
        return t


def lognormal_params(mean_s: float, sd_s: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and standard deviation (moments matched exactly)."""
    if not (mean_s > 0 and sd_s >= 0):
        raise ValueError(f"lognormal needs mean > 0 and sd >= 0, got {mean_s}, {sd_s}")
    sigma2 = math.log1p((sd_s / mean_s) ** 2)
    return math.log(mean_s) - sigma2 / 2, math.sqrt(sigma2)


def sample_pause_s(rng: random.Random, mean_s: float, sd_s: float, max_s: float) -> float:
    """Heavy-tailed tool time, like SWE-agent shell calls (default mean 0.9 s, sd 3.5 s), capped at max_s."""
    mu, sigma = lognormal_params(mean_s, sd_s)
    return min(rng.lognormvariate(mu, sigma), max_s)


def program_rng(seed: int | None) -> random.Random:
    """The program's random draws (its text, tool times): from ``seed`` when given, so that the same
    programs run in every A/B run (``hintflow run`` seeds each from ``--seed`` and its index); else
    Temporal's deterministic per-run random.  Both replay the same way."""
    from temporalio import workflow

    return random.Random(seed) if seed is not None else workflow.random()


def fixed_prefix(key: str, num_tokens: int, vocab_size: int) -> list[int]:
    """The same tokens for the same key in every program: a role's system prompt, shared across sessions."""
    rng = random.Random(key)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]
