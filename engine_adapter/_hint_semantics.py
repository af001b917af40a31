"""What each hint means, written once for both engines.

The embedded node (``_hint_enforcement``) and the vLLM node (``vllm_backend._hint_service``) keep sessions,
pins and queues on different structures; each adapts its own to :class:`HintTarget`, and
:func:`apply_hint` decides, for both, which sessions a hint concerns, what is refused (and with which
code), what is recorded before its session arrives, and what the acknowledgement says.  The two engines
had each a copy of this table; they disagreed on messages and on a ``Priority`` that comes before its
turn.

Errors are :mod:`._engine_errors` (``NotFound``, ``InvalidArgument``); each carries its gRPC code.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from hints import (
    EvictionOrder,
    Expect,
    HintDecodeError,
    HintModel,
    HintResult,
    Pin,
    Prefetch,
    Priority,
    Release,
)

from ._engine_errors import InvalidArgument, NotFound

__all__ = ["HintTarget", "PinGrantLike", "apply_hint"]

S = TypeVar("S")


class PinGrantLike(Protocol):
    """What an engine's pin call answers (``_session_table.PinResult``, ``vllm_backend._sessions``'s)."""

    @property
    def deferred(self) -> bool: ...
    @property
    def clamped(self) -> bool: ...
    @property
    def pinned_blocks(self) -> int: ...
    @property
    def requested_blocks(self) -> int: ...


class HintTarget(Protocol[S]):
    """One engine's sessions as the hint table sees them.  Called under the engine's hint lock.

    ``*_note`` methods return what the acknowledgement should add ("" for nothing): an engine that can
    only record a hint says so there."""

    node_id: str

    def now(self) -> float: ...
    def find(self, session_id: str) -> S | None: ...
    def record(self, session_id: str, program_id: str) -> S: ...  # the session, made if new (no blocks)
    def program_of(self, s: S) -> str: ...
    def sessions_of(self, program_id: str) -> list[S] | None: ...  # None: a program this node never saw
    def pin(self, s: S, ttl_s: float) -> PinGrantLike: ...
    def pin_note(self) -> str: ...
    def release(self, program_id: str) -> None: ...
    def prioritize(self, sessions: list[S], start_s: float, priority_class: int) -> None: ...
    def priority_note(self) -> str: ...
    def next_use(self, known: list[tuple[S, float]]) -> None: ...  # (session, seconds from now)
    def prefetch(self, s: S, at_s: float) -> str: ...  # the note
    def expect(self, s: S, output_tokens: int) -> None: ...


def _known(t: HintTarget[S], session_id: str) -> S:
    s = t.find(session_id)
    if s is None:
        raise NotFound(f"unknown session {session_id!r} on node {t.node_id}")
    return s


def apply_hint(t: HintTarget[S], i: int, h: HintModel | HintDecodeError) -> HintResult:
    """Apply one hint; its result.  Raises ``NotFound`` / ``InvalidArgument`` for a refusal."""
    if isinstance(h, HintDecodeError):
        raise InvalidArgument(str(h))
    if isinstance(h, Pin):
        g = t.pin(_known(t, h.session_id), h.ttl_s)
        msg = t.pin_note()
        if not msg and g.clamped:
            msg = f"pin clamped to {g.pinned_blocks} of {g.requested_blocks} blocks by the pin budget"
        if not msg and g.deferred:
            msg = "pin applies when the running turn ends"
        return HintResult(
            index=i, message=msg, clamped=g.clamped, pinned_blocks=g.pinned_blocks,
            requested_blocks=g.requested_blocks, deferred=g.deferred,
        )  # fmt: skip
    if isinstance(h, Priority):
        # The orchestrator sends a turn's Priority as it routes the turn, so it may come just before the
        # turn's request: with its program named, it records the session (no blocks) and the turn queues in
        # its program's place.  (As NOT_FOUND, a session new to this node queued as the youngest program's,
        # behind every other: 50-70 s in `hintflow demo`.)  A Release of the program frees the record.
        if not h.program_id:
            sessions = [_known(t, h.session_id)]
        else:
            first = t.record(h.session_id, h.program_id)
            if t.program_of(first) != h.program_id:
                raise InvalidArgument(
                    f"session {h.session_id!r} belongs to program {t.program_of(first)!r}, not {h.program_id!r}"
                )
            sessions = [first] + [s for s in t.sessions_of(h.program_id) or () if s is not first]
        t.prioritize(sessions, t.now() - h.program_age_s, h.priority_class)
        return HintResult(index=i, message=t.priority_note())
    if isinstance(h, EvictionOrder):
        known, unknown = [], []
        for e in h.entries:
            s = t.find(e.session_id)
            if s is None:
                unknown.append(e.session_id)
            else:
                known.append((s, e.next_use_s))
        t.next_use(known)
        if unknown:
            raise NotFound(f"{len(unknown)} unknown session(s), e.g. {unknown[0]!r}; the others were applied")
        return HintResult(index=i)
    if isinstance(h, Prefetch):
        return HintResult(index=i, message=t.prefetch(_known(t, h.session_id), h.at_s))
    if isinstance(h, Expect):
        t.expect(_known(t, h.session_id), h.output_tokens)
        return HintResult(index=i)
    if isinstance(h, Release):
        if t.sessions_of(h.program_id) is None:
            raise NotFound(f"unknown program {h.program_id!r} on node {t.node_id}")
        t.release(h.program_id)
        return HintResult(index=i)
    raise InvalidArgument(f"unsupported hint {type(h).__name__}")
