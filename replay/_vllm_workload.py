"""Agent programs for the real-vLLM benchmark: token ids per turn, tool pauses, Poisson arrivals.

Why its own shape: the benchmark sends real prompts (token-id lists) to a real server, so each program
needs concrete token ids that grow turn by turn (each turn's prompt is the previous prompt plus the tool's
output, the way an agent resends its whole context), not only the token counts of ``replay``'s traces.
Two sources: a built-in generator sized for a 2-core CPU (first prompt 1-2k tokens, +100-300 per turn,
6-12 turns, lognormal pauses), and any of ``replay``'s programs (``agent_programs``: its generators and
trace files, as ``hintflow replay --backend vllm`` loads them; ``swe_agent_programs`` for the benchmark).

A replay program becomes one with the same shape: each turn's ``input_tokens`` random token ids (a
``shared_prefix`` the same ids in every session that names its key), its ``output_tokens`` capped at
``max_output`` (at least 1: the tiny model's outputs are noise, and decoding them costs the CPU most), its
tool and pause as recorded. The client resends the whole context each turn but not the model's output
(the benchmark's prompts are token ids it chose; the noise it got back is not replayed), so a turn's
prompt is every earlier input plus its own. Sessions keep their ``after`` / ``join`` (``AgentSession``);
a one-session program keeps the benchmark's shape (``turns``; its session is the program).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay._trace import Program, Turn

__all__ = [
    "AgentProgram",
    "AgentSession",
    "AgentTurn",
    "agent_program",
    "agent_programs",
    "builtin_programs",
    "export_trace",
    "pool_blocks_for",
    "swe_agent_programs",
]

BLOCK = 128
MAX_OUTPUT = 32
"""Output tokens per call at most, for replay's programs (hundreds of decode steps per turn would make the
tiny model's decoding, not KV reuse, the run's cost on a CPU)."""


@dataclass(frozen=True)
class AgentTurn:
    new_tokens: tuple[int, ...]  # appended to the context before this call (the first turn: the prompt)
    output_tokens: int
    tool: str | None  # runs after this turn (None on the last)
    pause_s: float


@dataclass(frozen=True)
class AgentSession:
    """One KV context of a program: its turns, and the sessions of the program that must finish first.

    ``after`` empty: starts when the program arrives; else when all (``join="and"``) or the first
    (``"or"``) of them finish (replay's ``Session``). A session finishes after its last turn and that
    turn's tool, if any.
    """

    session_id: str
    turns: tuple[AgentTurn, ...]
    after: tuple[str, ...] = ()
    join: str = "and"

    def context_tokens(self, k: int) -> int:
        """Prompt length of turn ``k`` (0-based)."""
        return sum(len(t.new_tokens) for t in self.turns[: k + 1])

    @property
    def max_context(self) -> int:
        return self.context_tokens(len(self.turns) - 1) + self.turns[-1].output_tokens

    def unloaded_s(self, turn_s: float) -> float:
        """Pauses plus ``turn_s`` per turn: how long the session lasts on an idle engine."""
        return sum(t.pause_s for t in self.turns) + turn_s * len(self.turns)


@dataclass(frozen=True)
class AgentProgram:
    """An agent run: one session's ``turns`` (the benchmark's programs; the session is the program), or
    ``sessions`` with their ``after`` / ``join`` (replay's multi-session programs); exactly one is given."""

    program_id: str
    arrival_s: float
    turns: tuple[AgentTurn, ...] = ()
    sessions: tuple[AgentSession, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.turns) == bool(self.sessions):
            raise ValueError(f"program {self.program_id!r}: give turns or sessions (exactly one of them)")
        ids = [s.session_id for s in self.sessions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"program {self.program_id!r}: duplicate session ids {ids}")
        for s in self.sessions:
            if not s.turns:
                raise ValueError(f"program {self.program_id!r}: session {s.session_id!r} has no turns")
            unknown = sorted(set(s.after) - set(ids))
            if unknown or s.session_id in s.after or s.join not in ("and", "or"):
                raise ValueError(f"program {self.program_id!r}: session {s.session_id!r}: bad after {list(s.after)} "
                                 f"or join {s.join!r}")  # fmt: skip

    @property
    def all_sessions(self) -> tuple[AgentSession, ...]:
        """The sessions; a one-session program's is named after the program (as its requests are)."""
        return self.sessions or (AgentSession(self.program_id, self.turns),)

    def context_tokens(self, k: int) -> int:
        """Prompt length of turn ``k`` (0-based) of a one-session program."""
        return self.all_sessions[0].context_tokens(k)

    @property
    def max_context(self) -> int:
        return max(s.max_context for s in self.all_sessions)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.all_sessions)

    def unloaded_s(self, turn_s: float) -> float:
        """Critical path on an idle engine: each session's pauses plus ``turn_s`` per turn, after its
        predecessors (all of them for an AND join, the first for an OR join)."""
        done: dict[str, float] = {}
        pending = list(self.all_sessions)
        while pending:
            for s in pending:
                if all(d in done for d in s.after):
                    deps = [done[d] for d in s.after]
                    start = (max(deps) if s.join == "and" else min(deps)) if deps else 0.0
                    done[s.session_id] = start + s.unloaded_s(turn_s)
                    pending.remove(s)
                    break
            else:
                raise ValueError(f"program {self.program_id!r}: the sessions' after dependencies have a cycle")
        return max(done.values())

    def mean_live_context(self, turn_s: float) -> float:
        """Context tokens held, averaged over the program's unloaded lifetime (each session's mean over its
        turns, for as long as it runs); a one-session program's mean context over its turns."""
        sessions = self.all_sessions
        means = [sum(s.context_tokens(k) for k in range(len(s.turns))) / len(s.turns) for s in sessions]
        if len(sessions) == 1:
            return means[0]
        span = self.unloaded_s(turn_s) or 1.0
        return sum(m * s.unloaded_s(turn_s) for m, s in zip(means, sessions, strict=True)) / span


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
    """``replay``'s swe-agent programs with token counts times ``scale`` and pauses times ``pause_scale``.

    Every token random, the shared system prompt too (as measured in docs/benchmarks.md; ``agent_programs``
    shares it)."""
    from replay._generator_registry import generate

    rng = random.Random(f"swe/{seed}/tokens")
    return [
        agent_program(p, rng, max_output=max_output, pause_scale=pause_scale, shared_prefixes=False)
        for p in generate("swe-agent", seed=seed, num_programs=n, rate=rate, scale=scale)
    ]


def agent_program(
    program: Program,
    rng: random.Random,
    *,
    max_output: int = MAX_OUTPUT,
    pause_scale: float = 1.0,
    shared_prefixes: bool = True,
    prefix_seed: int = 0,
) -> AgentProgram:
    """One replay program as token ids (module docstring): ``rng`` draws the tokens, turn by turn; a
    shared prefix's ids come from its key and ``prefix_seed`` (with ``shared_prefixes``), the rest of that
    turn's input from ``rng``. Outputs are capped at ``max_output`` and at least 1; pauses times
    ``pause_scale``."""

    def turn(t: Turn) -> AgentTurn:
        shared = t.shared_prefix_tokens if shared_prefixes else 0
        prefix = _tokens(random.Random(f"prefix/{prefix_seed}/{t.shared_prefix}"), shared) if shared else ()
        pause = t.tool_duration_s * pause_scale if t.tool is not None else 0.0
        return AgentTurn(prefix + _tokens(rng, t.input_tokens - shared), max(1, min(max_output, t.output_tokens)),
                         t.tool, pause)  # fmt: skip

    if len(program.sessions) == 1:
        return AgentProgram(program.program_id, program.arrival_s, tuple(turn(t) for t in program.sessions[0].turns))
    sessions = tuple(
        AgentSession(s.session_id, tuple(turn(t) for t in s.turns), tuple(s.after), s.join) for s in program.sessions
    )
    return AgentProgram(program.program_id, program.arrival_s, sessions=sessions)


def agent_programs(programs: Sequence[Program], *, seed: int = 0, max_output: int = MAX_OUTPUT) -> list[AgentProgram]:
    """Replay programs as token ids (``agent_program``), each program's tokens from its own stream (seeded
    by ``seed`` and its id, so a program's tokens do not depend on which others are replayed)."""
    return [
        agent_program(p, random.Random(f"replay/{seed}/{p.program_id}"), max_output=max_output, prefix_seed=seed)
        for p in programs
    ]


def pool_blocks_for(programs: list[AgentProgram], *, fraction: float, turn_s: float = 0.3) -> tuple[int, float]:
    """(blocks, expected live programs): ``fraction`` of the live programs' mean context, in blocks.

    Live programs by Little's law: arrival rate x unpressured duration (pauses + ``turn_s`` per turn, along
    the sessions' critical path); a live program's context is its mean over turns (``mean_live_context``).
    """
    if not programs:
        return 1, 0.0
    span = max(p.arrival_s for p in programs) or 1.0
    rate = len(programs) / span
    durations = [p.unloaded_s(turn_s) for p in programs]
    live = rate * sum(durations) / len(durations)
    ctx = [p.mean_live_context(turn_s) for p in programs]
    tokens = live * sum(ctx) / len(ctx)
    return max(1, math.ceil(fraction * tokens / BLOCK)), live


def export_trace(programs: list[AgentProgram]) -> str:
    """The programs as hintflow trace lines (docs/trace-format.md): token counts and pauses, no token ids,
    so ``hintflow replay`` can run the same workload on modeled nodes."""
    lines = []
    for p in programs:
        sessions = []
        for s in p.all_sessions:
            turns = [
                {"input_tokens": len(t.new_tokens), "output_tokens": t.output_tokens, "tool": t.tool,
                 "tool_duration_s": round(t.pause_s, 3) if t.tool is not None else 0.0}
                for t in s.turns
            ]  # fmt: skip
            if not p.sessions:  # the benchmark's one-session programs, as they were always written
                sessions.append({"session_id": "agent", "role": "agent", "turns": turns})
            else:
                sessions.append({"session_id": s.session_id, "role": "agent", "turns": turns,
                                 "after": list(s.after), "join": s.join})  # fmt: skip
        lines.append(json.dumps({"program_id": p.program_id, "arrival_s": round(p.arrival_s, 3),
                                 "workload": "vllm-bench", "sessions": sessions}))  # fmt: skip
    return "\n".join(lines) + "\n"
