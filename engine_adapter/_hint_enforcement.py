"""Hint enforcement on the embedded node: its KV manager and scheduler as a ``HintTarget``.

``EngineCore.apply_hints`` calls ``apply_hint`` for each hint under the engine's lock, so an
acknowledgement means the node's state already reflects the hint.  What each hint means (which sessions,
what is refused, what is recorded ahead of its session) is ``_hint_semantics``, shared with the vLLM node;
this module says only how this engine carries it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hints import HintDecodeError, HintModel, HintResult

from ._hint_semantics import apply_hint as _apply
from ._session import Session
from ._session_table import PinResult

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["apply_hint"]


class _EmbeddedTarget:
    def __init__(self, core: EngineCore) -> None:
        self.core, self.kv, self.node_id = core, core.kv, core.node_id

    def now(self) -> float:
        return self.core.clock.now()

    def find(self, session_id: str) -> Session | None:
        return self.kv.sessions.get(session_id)

    def record(self, session_id: str, program_id: str) -> Session:
        return self.kv.get_or_create(session_id, program_id)

    def program_of(self, s: Session) -> str:
        return s.program_id

    def sessions_of(self, program_id: str) -> list[Session] | None:
        members = self.kv.programs.get(program_id)
        if members is None:
            return None
        return [s for sid in members if (s := self.kv.sessions.get(sid)) is not None]

    def pin(self, s: Session, ttl_s: float) -> PinResult:
        r = self.kv.set_pin(s, ttl_s)
        self.core.scheduler.mark_priorities_changed()  # pinned sessions sort first
        return r

    def pin_note(self) -> str:
        return ""

    def release(self, program_id: str) -> None:
        self.kv.release_program(program_id)

    def prioritize(self, sessions: list[Session], start_s: float, priority_class: int) -> None:
        for s in sessions:
            s.program_start_s = start_s
            s.priority_class = priority_class
        self.core.scheduler.mark_priorities_changed()

    def priority_note(self) -> str:
        return ""

    def next_use(self, known: list[tuple[Session, float]]) -> None:
        for s, next_use_s in known:
            self.kv.set_next_use(s, next_use_s)

    def prefetch(self, s: Session, at_s: float) -> str:
        self.kv.set_prefetch(s, at_s)
        return ""

    def expect(self, s: Session, output_tokens: int) -> None:
        s.expected_output_tokens = output_tokens


def apply_hint(core: EngineCore, i: int, h: HintModel | HintDecodeError) -> HintResult:
    return _apply(_EmbeddedTarget(core), i, h)
