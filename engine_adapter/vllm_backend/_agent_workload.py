"""Agent programs for the real-vLLM benchmark: token ids per turn, tool pauses, Poisson arrivals.

Why its own shape: the benchmark sends real prompts (token-id lists) to a real server, so each program
needs concrete token ids that grow turn by turn (each turn's prompt is the previous prompt plus the tool's
output, the way an agent resends its whole context), not only the token counts of ``replay``'s traces.
Two sources: a built-in generator sized for a 2-core CPU (first prompt 1-2k tokens, +100-300 per turn,
6-12 turns, lognormal pauses), and ``replay``'s ``swe-agent`` generator with its ``scale`` (single-session
programs; pauses keep their real lengths there, times ``pause_scale``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

__all__ = ["AgentProgram", "AgentTurn", "builtin_programs", "export_trace", "pool_blocks_for", "swe_agent_programs"]

BLOCK = 128


@dataclass(frozen=True)
class AgentTurn:
    new_tokens: tuple[int, ...]  # appended to the context before this call (the first turn: the prompt)
    output_tokens: int
    tool: str | None  # runs after this turn (None on the last)
    pause_s: float


@dataclass(frozen=True)
class AgentProgram:
    program_id: str
    arrival_s: float
    turns: tuple[AgentTurn, ...]

    def context_tokens(self, k: int) -> int:
        """Prompt length of turn ``k`` (0-based)."""
        return sum(len(t.new_tokens) for t in self.turns[: k + 1])

    @property
    def max_context(self) -> int:
        return self.context_tokens(len(self.turns) - 1) + self.turns[-1].output_tokens


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, 1000) for _ in range(n))


def _arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def builtin_programs(
    n: int,
    *,
    rate: float,
    seed: int = 0,
    first: tuple[int, int] = (1000, 2000),
    per_turn: tuple[int, int] = (100, 300),
    turns: tuple[int, int] = (6, 12),
    output: tuple[int, int] = (8, 32),
    pause_mean_s: float = 1.0,
    pause_sigma: float = 0.8,
) -> list[AgentProgram]:
    """``n`` programs arriving as a Poisson process at ``rate`` per second (deterministic per ``seed``).

    Pauses are lognormal with mean ``pause_mean_s`` (sigma ``pause_sigma``); tools are drawn from three
    names with different means (x0.5, x1, x2), so per-tool statistics matter.
    """
    rng = random.Random(f"agent/{seed}")
    arrivals = _arrivals(n, rate, random.Random(f"agent/{seed}/arrivals"))
    tools = {"grep": 0.5, "edit": 1.0, "test": 2.0}
    out = []
    for i, at in enumerate(arrivals):
        k = rng.randint(*turns)
        ts = []
        for j in range(k):
            size = rng.randint(*first) if j == 0 else rng.randint(*per_turn)
            last = j == k - 1
            tool = None if last else rng.choice(sorted(tools))
            pause = 0.0
            if tool is not None:
                mean = pause_mean_s * tools[tool]
                pause = rng.lognormvariate(math.log(mean) - pause_sigma**2 / 2, pause_sigma)
            ts.append(AgentTurn(_tokens(rng, size), rng.randint(*output), tool, pause))
        out.append(AgentProgram(f"agent-{i}", at, tuple(ts)))
    return out


def swe_agent_programs(
    n: int, *, rate: float, seed: int = 0, scale: float = 0.1, pause_scale: float = 1.0, max_output: int = 32
) -> list[AgentProgram]:
    """``replay``'s swe-agent programs with token counts times ``scale`` and pauses times ``pause_scale``."""
    from replay._generators import generate

    rng = random.Random(f"swe/{seed}/tokens")
    out = []
    for p in generate("swe-agent", seed=seed, num_programs=n, rate=rate, scale=scale):
        turns = p.sessions[0].turns
        ts = tuple(
            AgentTurn(
                _tokens(rng, t.input_tokens),
                min(max_output, t.output_tokens),
                t.tool,
                t.tool_duration_s * pause_scale,
            )
            for t in turns
        )
        out.append(AgentProgram(p.program_id, p.arrival_s, ts))
    return out


def pool_blocks_for(programs: list[AgentProgram], *, fraction: float, turn_s: float = 0.3) -> tuple[int, float]:
    """(blocks, expected live programs): ``fraction`` of the live programs' mean context, in blocks.

    Live programs by Little's law: arrival rate x unpressured duration (pauses + ``turn_s`` per turn); a
    live program's context is its mean over turns.
    """
    if not programs:
        return 1, 0.0
    span = max(p.arrival_s for p in programs) or 1.0
    rate = len(programs) / span
    durations = [sum(t.pause_s for t in p.turns) + turn_s * len(p.turns) for p in programs]
    live = rate * sum(durations) / len(durations)
    ctx = [sum(p.context_tokens(k) for k in range(len(p.turns))) / len(p.turns) for p in programs]
    tokens = live * sum(ctx) / len(ctx)
    return max(1, math.ceil(fraction * tokens / BLOCK)), live


def export_trace(programs: list[AgentProgram]) -> str:
    """The programs as hintflow trace lines (docs/trace-format.md): token counts and pauses, no token ids,
    so ``hintflow replay`` can run the same workload on modeled nodes."""
    lines = []
    for p in programs:
        turns = [
            {"input_tokens": len(t.new_tokens), "output_tokens": t.output_tokens, "tool": t.tool,
             "tool_duration_s": round(t.pause_s, 3) if t.tool is not None else 0.0}
            for t in p.turns
        ]  # fmt: skip
        session = {"session_id": "agent", "role": "agent", "turns": turns}
        lines.append(json.dumps({"program_id": p.program_id, "arrival_s": round(p.arrival_s, 3),
                                 "workload": "vllm-bench", "sessions": [session]}))  # fmt: skip
    return "\n".join(lines) + "\n"
