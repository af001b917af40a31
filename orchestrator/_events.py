"""Program events (what the orchestrator observes) and the policy protocol that turns them into hints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hints import (
    HintModel,
)


# ---- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TurnStarted:
    program_id: str
    session_id: str
    now_s: float
    context_tokens: int
    workflow: str = ""  # the program's type (Temporal workflow type): whose learned graph it follows


@dataclass(frozen=True, slots=True)
class TurnEnded:
    program_id: str
    session_id: str
    now_s: float
    context_tokens: int


@dataclass(frozen=True, slots=True)
class ToolStarted:
    program_id: str
    session_id: str
    tool: str
    now_s: float
    context_tokens: int
    workflow: str = ""


@dataclass(frozen=True, slots=True)
class ToolEnded:
    program_id: str
    session_id: str
    tool: str
    now_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class ProgramEnded:
    program_id: str
    now_s: float
    num_turns: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic re-decision (pin renewal, changed predictions)."""

    now_s: float


Event = TurnStarted | TurnEnded | ToolStarted | ToolEnded | ProgramEnded | Tick


@runtime_checkable
class HintPolicy(Protocol):
    """Turns one event into the hints to send now (possibly none).

    ``num_invalid_hints`` counts hints the policy computed but dropped because they failed validation.
    """

    name: str
    num_invalid_hints: int

    def on_event(self, event: Event) -> list[HintModel]: ...
