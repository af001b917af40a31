"""Per-program and per-session progress of a replay, and the record each finished turn leaves.

Kept apart from the event loop so the join rules (AND: all predecessors, OR: the first) and the turn
accounting can be read and tested on their own.  Token accounting follows the engine's metrics
(``engine_adapter/_metrics.py``): *history* is what the session computed in earlier turns, an
*across-turn hit* is the part of that found on device or reloaded from host, a *within-turn hit* is any
other hit (a prefix shared with other sessions), and *recomputed* is history that had to be prefilled again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_adapter import Request
from replay._trace import Program, Session

__all__ = ["ProgramRun", "SessionRun", "TurnRecord"]


@dataclass(eq=False)
class SessionRun:
    """One session's state: which turn is next, its context (token ids), where it runs, its pause."""

    run: ProgramRun
    session: Session
    key: str  # "program/session": unique across the replay, the engine's session id
    turn_index: int = 0
    context: list[int] = field(default_factory=list)  # prompt + output of the last finished turn (or the prompt)
    prompt: list[int] = field(default_factory=list)  # the prompt of the turn in flight
    node: str = ""
    request: Request | None = None
    migrated_tokens: int = 0  # context tokens copied in from another node for the turn in flight
    num_moves: int = 0  # times the turn in flight was moved to another node (``replay/_migration.py``)
    landed_s: float = 0.0  # when the turn in flight was last submitted (to its node, or to the node it moved to)
    ready_s: float = 0.0  # when the current turn became ready (submit, or entry to ThunderAgent's queue)
    started: bool = False
    finished_s: float | None = None

    def next_prompt(self, new_input: list[int]) -> list[int]:
        self.started = True
        return self.context + new_input

    def finish_turn(self, output: list[int]) -> None:
        self.context = self.prompt + output
        self.prompt = []
        self.request = None


@dataclass(eq=False)
class ProgramRun:
    """A program's sessions and join state; ``finish_session`` says which sessions may start next."""

    program: Program
    sessions: dict[str, SessionRun] = field(default_factory=dict)
    arrival_s: float = 0.0
    end_s: float | None = None
    num_turns_done: int = 0
    _done: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, program: Program) -> ProgramRun:
        run = cls(program, arrival_s=program.arrival_s)
        pid = program.program_id
        run.sessions = {s.session_id: SessionRun(run, s, f"{pid}/{s.session_id}") for s in program.sessions}
        return run

    def start(self, now_s: float) -> None:
        self.arrival_s = now_s

    def finish_session(self, session_id: str, now_s: float) -> list[str]:
        """Mark ``session_id`` done; the successors whose join is now satisfied and that have not started."""
        s = self.sessions[session_id]
        s.finished_s = now_s
        self.num_turns_done += s.session.num_turns
        self._done.add(session_id)
        ready = []
        for succ_id in self.program.successors(session_id):
            succ = self.sessions[succ_id]
            deps = succ.session.after
            met = all(d in self._done for d in deps) if succ.session.join == "and" else True
            if met and not succ.started:
                succ.started = True
                ready.append(succ_id)
        return ready

    @property
    def all_done(self) -> bool:
        return len(self._done) == len(self.sessions)

    def close(self) -> None:
        """The program ended: drop token lists (the replay keeps only records)."""
        self.end_s = max(s.finished_s or 0.0 for s in self.sessions.values())
        for s in self.sessions.values():
            s.context, s.prompt = [], []

    @property
    def jct_s(self) -> float:
        return (self.end_s or self.arrival_s) - self.arrival_s


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One finished turn: times (s, virtual) and where its prompt tokens came from."""

    program_id: str
    session_key: str
    turn_index: int
    node: str
    ready_s: float
    first_token_s: float
    finished_s: float
    queue_wait_s: float  # ready -> first scheduled (ThunderAgent's global queue included)
    ttft_s: float  # ready -> first token (host reload time included: it runs in the step)
    prompt_tokens: int
    output_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    history_tokens: int
    recomputed_tokens: int
    preemptions: int
    migrated_tokens: int = 0  # context copied in from another node while the turn queued (a migration)

    @classmethod
    def of(cls, s: SessionRun, req: Request, config: str) -> TurnRecord:
        first_sched = req.first_scheduled_s if req.first_scheduled_s is not None else req.arrival_s
        first_tok = req.first_token_s if req.first_token_s is not None else (req.finished_s or req.arrival_s)
        # History is what the session computed in earlier turns, wherever that was: a session routed to
        # another node finds none of it there, and the node alone would count it as new prompt.
        history, recomputed = req.num_history_tokens, req.num_recomputed_tokens
        if s.turn_index > 0 and s.context:
            history = max(history, len(s.context) - 1)  # the last sampled token was never computed
            recomputed = max(recomputed, history - req.num_cached_tokens - req.num_host_hit_tokens)
        return cls(
            s.run.program.program_id, s.key, s.turn_index, s.node, s.ready_s, first_tok,
            req.finished_s or first_tok, first_sched - s.ready_s, first_tok - s.ready_s, len(req.prompt),
            len(req.output), req.num_cached_tokens, req.num_host_hit_tokens, history, recomputed,
            req.num_preemptions, s.migrated_tokens,
        )

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def across_hit_tokens(self) -> int:
        return min(self.hit_tokens, self.history_tokens)

    @property
    def within_hit_tokens(self) -> int:
        return self.hit_tokens - self.across_hit_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens
