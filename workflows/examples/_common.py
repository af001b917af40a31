"""What the example agents share: per-turn reports and heavy-tailed pause sampling (workflow-safe)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from workflows._api import LLMResult

__all__ = ["ProgramReport", "TurnReport", "fixed_prefix", "lognormal_params", "sample_pause_s"]


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


def fixed_prefix(key: str, num_tokens: int, vocab_size: int) -> list[int]:
    """The same tokens for the same key in every program: a role's system prompt, shared across sessions."""
    rng = random.Random(key)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]
