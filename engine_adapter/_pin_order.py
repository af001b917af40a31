"""Which pins give way, and in what order: program-level FCFS over pinned sessions, for both engines.

Why one module: the embedded node (``_session_table.SessionTable``) and the vLLM node
(``vllm_backend._sessions.SessionBook``) keep pins on different structures, but a pin must mean the
same on both. Two rules decide which pins let go before their lease ends, and both follow program age
(the program that started first goes first, Continuum's program-level FCFS):

- **deadlock**: pinned memory blocks all progress (a step would schedule nothing while work waits), so
  the latest-started program lets go of every pin it holds. Continuum unpins "the latest-arriving
  program"; its sessions go together, since a program's next turn may be any of them;
- **yield**: a waiting turn that memory cannot take makes the pins of programs younger than its own let
  go, youngest first, until it fits: a pin is a bet that its program comes back soon, and it must not
  keep an older program's turn, which is already here, waiting.

Sessions are duck-typed: each engine passes how to read a session's program, its program's start (from a
``Priority`` hint, else when the node first saw it) and when it was first seen (the tie-break).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["deadlock_victims", "program_start", "yield_order"]

S = TypeVar("S")


def program_start(start_s: float | None, first_seen_s: float) -> float:
    """A session's place in program FCFS: its program's start if a hint gave one, else when first seen.

    (``is None``, not falsiness: a program that started at time 0.0 on a virtual clock is the oldest.)"""
    return first_seen_s if start_s is None else start_s


def deadlock_victims(
    pinned: Iterable[S], *, start: Callable[[S], float], seen: Callable[[S], float], program: Callable[[S], str]
) -> list[S]:
    """The pinned sessions of the latest-started program (empty when nothing is pinned)."""
    sessions = list(pinned)
    if not sessions:
        return []
    latest = program(max(sessions, key=lambda s: (start(s), seen(s))))
    return [s for s in sessions if program(s) == latest]


def yield_order(
    pinned: Iterable[S], older_than_s: float, *, start: Callable[[S], float], seen: Callable[[S], float]
) -> list[S]:
    """Pinned sessions of programs that started after ``older_than_s``, youngest first: the order in which
    their pins give way to an older program's waiting turn."""
    younger = [s for s in pinned if start(s) > older_than_s]
    return sorted(younger, key=lambda s: (start(s), seen(s)), reverse=True)
