"""The agent-workload trace: programs of sessions of turns, validated when built, stored one program a line.

The vocabulary of docs/architecture.md: a *program* is one agent run, a *session* one continuing KV context inside it, a
*turn* one model call.  A trace holds token counts and pause lengths, never text, because that is all a
KV cache and a scheduler see: a turn's ``input_tokens`` are the tokens *appended* to its session's context
before the call (on the first turn, the whole first prompt), so a replay can tell a reusable prefix from
new work.  The schema is in docs/trace-format.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["JOIN_KINDS", "JoinKind", "Program", "Session", "TraceError", "Turn", "scale_tokens"]

JoinKind = Literal["and", "or"]
JOIN_KINDS: tuple[JoinKind, ...] = ("and", "or")


class TraceError(ValueError):
    """A trace line that cannot be used: the message names the file, the 1-based line and the problem."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


def _check_count(name: str, value: object, minimum: int = 0) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    ok = (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    )
    if not ok:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def scale_tokens(num_tokens: int, scale: float) -> int:
    """``num_tokens * scale`` rounded, at least 1 unless it was 0: a scaled-down turn still does some work."""
    return 0 if num_tokens == 0 else max(1, round(num_tokens * scale))


@dataclass(frozen=True, slots=True)
class Turn:
    """One model call: append ``input_tokens`` to the context, generate ``output_tokens``, then run ``tool``.

    ``tool_duration_s`` is how long the tool (or the person, tool ``"human"``) held the session before the
    next turn; it is 0 when ``tool`` is None.  ``shared_prefix`` names a block of ``shared_prefix_tokens``
    at the start of this turn's input that other sessions with the same key also start with (an agent's
    fixed system prompt); only a session's first turn may have one.  ``hash_ids`` carry a trace's own
    prefix identity (Mooncake): one id per ``block_size``-token block of the whole prompt of this call,
    chained from the start, the last block possibly partial; equal ids mean equal blocks.  Tokens covered
    by neither are unique to the session.
    """

    input_tokens: int
    output_tokens: int
    tool: str | None = None
    tool_duration_s: float = 0.0
    shared_prefix: str = ""
    shared_prefix_tokens: int = 0
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0

    def __post_init__(self) -> None:
        _check_count("input_tokens", self.input_tokens)
        _check_count("output_tokens", self.output_tokens)
        if self.tool is not None:
            _check_name("tool", self.tool)
        _check_seconds("tool_duration_s", self.tool_duration_s)
        object.__setattr__(self, "tool_duration_s", float(self.tool_duration_s))
        if self.tool is None and self.tool_duration_s != 0.0:
            raise ValueError(f"tool_duration_s must be 0 when tool is None, got {self.tool_duration_s!r}")
        if not isinstance(self.shared_prefix, str):
            raise ValueError(f"shared_prefix must be a string, got {self.shared_prefix!r}")
        _check_count("shared_prefix_tokens", self.shared_prefix_tokens)
        if bool(self.shared_prefix) != (self.shared_prefix_tokens > 0):
            raise ValueError(
                "shared_prefix and shared_prefix_tokens > 0 go together, got "
                f"{self.shared_prefix!r} with {self.shared_prefix_tokens} tokens"
            )
        if self.shared_prefix_tokens > self.input_tokens:
            raise ValueError(
                f"shared_prefix_tokens ({self.shared_prefix_tokens}) must not exceed "
                f"input_tokens ({self.input_tokens})"
            )
        if not isinstance(self.hash_ids, Sequence) or isinstance(self.hash_ids, str):
            raise ValueError(f"hash_ids must be a list of integers, got {self.hash_ids!r}")
        object.__setattr__(self, "hash_ids", tuple(self.hash_ids))
        if any(type(h) is not int for h in self.hash_ids):
            raise ValueError("hash_ids must be a list of integers")
        _check_count("block_size", self.block_size, 1 if self.hash_ids else 0)
        if self.block_size and not self.hash_ids:
            raise ValueError(f"block_size ({self.block_size}) is set but hash_ids is empty")

    def scaled(self, scale: float) -> Turn:
        """The same turn with every token count (and the hash block size) multiplied by ``scale``."""
        return dataclasses.replace(
            self,
            input_tokens=scale_tokens(self.input_tokens, scale),
            output_tokens=scale_tokens(self.output_tokens, scale),
            shared_prefix_tokens=scale_tokens(self.shared_prefix_tokens, scale),
            block_size=scale_tokens(self.block_size, scale),
        )


@dataclass(frozen=True, slots=True)
class Session:
    """One KV context: its turns in order, and which sessions of the program must finish before it starts.

    With ``after`` empty the session starts when the program arrives; otherwise it starts when all
    (``join="and"``) or the first (``join="or"``) of those sessions finish.  A session finishes when its
    last turn's output, and that turn's tool if it has one, are done.  ``turns`` and ``after`` are stored
    as tuples.
    """

    session_id: str
    role: str
    turns: Sequence[Turn]
    after: Sequence[str] = ()
    join: JoinKind = "and"

    def __post_init__(self) -> None:
        _check_name("session_id", self.session_id)
        where = f"session {self.session_id!r}"
        _check_name(f"{where}: role", self.role)
        if isinstance(self.turns, str | bytes) or not isinstance(self.turns, Sequence):
            raise ValueError(f"{where}: turns must be a list of Turn, got {self.turns!r}")
        object.__setattr__(self, "turns", tuple(self.turns))
        if not self.turns:
            raise ValueError(f"{where}: turns must not be empty")
        for i, turn in enumerate(self.turns):
            if not isinstance(turn, Turn):
                raise ValueError(f"{where}: turn {i} is not a Turn, got {turn!r}")
            if i and turn.shared_prefix:
                raise ValueError(f"{where}: turn {i}: only the first turn may have a shared_prefix")
        if self.turns[0].input_tokens < 1:
            raise ValueError(f"{where}: turn 0: input_tokens must be >= 1 (a session starts with a prompt)")
        if isinstance(self.after, str) or not isinstance(self.after, Sequence):
            raise ValueError(f"{where}: after must be a list of session ids, got {self.after!r}")
        object.__setattr__(self, "after", tuple(self.after))
        for dep in self.after:
            _check_name(f"{where}: after entry", dep)
        if len(set(self.after)) != len(self.after):
            raise ValueError(f"{where}: after lists a session twice: {list(self.after)}")
        if self.session_id in self.after:
            raise ValueError(f"{where}: after names the session itself")
        if self.join not in JOIN_KINDS:
            raise ValueError(f"{where}: join must be 'and' or 'or', got {self.join!r}")

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def context_tokens(self) -> list[int]:
        """Per turn, the prompt length of that call: every earlier input and output plus this input."""
        lengths: list[int] = []
        total = 0
        for turn in self.turns:
            total += turn.input_tokens
            lengths.append(total)
            total += turn.output_tokens
        return lengths

    @property
    def total_tokens(self) -> int:
        """Tokens in the context when the session ends: all inputs and outputs."""
        return sum(t.input_tokens + t.output_tokens for t in self.turns)

    def scaled(self, scale: float) -> Session:
        return dataclasses.replace(self, turns=[t.scaled(scale) for t in self.turns])


@dataclass(frozen=True, slots=True)
class Program:
    """One agent run arriving at ``arrival_s`` (seconds from trace start): a DAG of sessions.

    ``workload`` names where it came from ("swe-agent", "mooncake", ...), so results can be split by kind.
    Construction checks that session ids are unique, that ``after`` names only sessions of this program,
    that the dependencies have no cycle, and that a shared prefix key has one length within the program.
    """

    program_id: str
    arrival_s: float
    workload: str
    sessions: Sequence[Session]

    def __post_init__(self) -> None:
        _check_name("program_id", self.program_id)
        where = f"program {self.program_id!r}"
        _check_seconds(f"{where}: arrival_s", self.arrival_s)
        object.__setattr__(self, "arrival_s", float(self.arrival_s))
        _check_name(f"{where}: workload", self.workload)
        if isinstance(self.sessions, str | bytes) or not isinstance(self.sessions, Sequence):
            raise ValueError(f"{where}: sessions must be a list of Session, got {self.sessions!r}")
        object.__setattr__(self, "sessions", tuple(self.sessions))
        if not self.sessions:
            raise ValueError(f"{where}: sessions must not be empty")
        ids: set[str] = set()
        for s in self.sessions:
            if not isinstance(s, Session):
                raise ValueError(f"{where}: {s!r} is not a Session")
            if s.session_id in ids:
                raise ValueError(f"{where}: duplicate session id {s.session_id!r}")
            ids.add(s.session_id)
        for s in self.sessions:
            unknown = [d for d in s.after if d not in ids]
            if unknown:
                raise ValueError(f"{where}: session {s.session_id!r}: after names unknown sessions {unknown}")
        order = self._kahn_order()
        if len(order) < len(self.sessions):
            stuck = sorted(s.session_id for s in self.sessions if s.session_id not in set(order))
            raise ValueError(f"{where}: the after dependencies have a cycle among sessions {stuck}")
        prefixes: dict[str, int] = {}
        for s in self.sessions:
            first = s.turns[0]
            if first.shared_prefix and prefixes.setdefault(
                first.shared_prefix, first.shared_prefix_tokens
            ) != (first.shared_prefix_tokens):
                raise ValueError(
                    f"{where}: shared_prefix {first.shared_prefix!r} has two lengths: "
                    f"{prefixes[first.shared_prefix]} and {first.shared_prefix_tokens}"
                )

    def _kahn_order(self) -> list[str]:
        waiting = {s.session_id: len(s.after) for s in self.sessions}
        ready = [s.session_id for s in self.sessions if not s.after]
        order: list[str] = []
        while ready:
            sid = ready.pop(0)
            order.append(sid)
            for succ in self.successors(sid):
                waiting[succ] -= 1
                if waiting[succ] == 0:
                    ready.append(succ)
        return order

    def topological_order(self) -> list[str]:
        """Session ids, each after everything it waits on; ties in declaration order."""
        return self._kahn_order()

    def session(self, session_id: str) -> Session:
        for s in self.sessions:
            if s.session_id == session_id:
                return s
        raise KeyError(f"program {self.program_id!r} has no session {session_id!r}")

    def successors(self, session_id: str) -> list[str]:
        """The sessions that list ``session_id`` in their ``after``."""
        return [s.session_id for s in self.sessions if session_id in s.after]

    @property
    def roots(self) -> list[str]:
        """The sessions that start when the program arrives."""
        return [s.session_id for s in self.sessions if not s.after]

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def num_turns(self) -> int:
        return sum(s.num_turns for s in self.sessions)

    @property
    def total_tokens(self) -> int:
        """All input and output tokens of all sessions (each token counted once, as the trace adds it)."""
        return sum(s.total_tokens for s in self.sessions)

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt any call of the program sends."""
        return max(max(s.context_tokens()) for s in self.sessions)

    def scaled(self, scale: float) -> Program:
        """Every token count times ``scale`` (at least 1 where it was not 0); times are unchanged."""
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if scale == 1:
            return self
        return dataclasses.replace(self, sessions=[s.scaled(scale) for s in self.sessions])
