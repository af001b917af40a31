"""Hint enforcement: what each hint does to one node's KV manager and scheduler.

``EngineCore.apply_hints`` calls ``apply_hint`` for each hint under the engine's lock, so an
acknowledgement means the node's state already reflects the hint.  Why apart from ``_engine``: the
hint semantics are one table (Pin, EvictionOrder, Priority, Prefetch, Expect, Release), read on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["apply_hint"]


def apply_hint(core: EngineCore, i: int, h: HintModel | HintDecodeError) -> HintResult:
    if isinstance(h, HintDecodeError):
        raise InvalidArgument(str(h))
    now = core.clock.now()
    if isinstance(h, Pin):
        s = core._session(h.session_id)
        r = core.kv.set_pin(s, h.ttl_s)
        msg = "pin applies when the running turn ends" if r.deferred else ""
        if r.clamped:
            msg = f"pin clamped to {r.pinned_blocks} of {r.requested_blocks} blocks by the pin budget"
        core.scheduler.mark_priorities_changed()
        return HintResult(
            index=i, message=msg, clamped=r.clamped, pinned_blocks=r.pinned_blocks, requested_blocks=r.requested_blocks
        )
    if isinstance(h, EvictionOrder):
        unknown = []
        for e in h.entries:
            s = core.kv.sessions.get(e.session_id)
            if s is None:
                unknown.append(e.session_id)
            else:
                core.kv.set_next_use(s, e.next_use_s)
        if unknown:
            raise NotFound(f"{len(unknown)} unknown session(s), e.g. {unknown[0]!r}; the others were applied")
        return HintResult(index=i)
    if isinstance(h, Priority):
        # The orchestrator sends a turn's Priority as it routes the turn, so it may come just before the
        # turn's request: with its program named, it records the session (no blocks) and the turn queues
        # in its program's place.  (Before, it was NOT_FOUND and a session new to this node queued as the
        # youngest program's, behind every other: 50-70 s in `hintflow demo`.)  A Release frees the record.
        first = core.kv.get_or_create(h.session_id, h.program_id) if h.program_id else core._session(h.session_id)
        if h.program_id and first.program_id != h.program_id:
            raise InvalidArgument(f"session {h.session_id!r} belongs to program {first.program_id!r}, not {h.program_id!r}")
        sessions = [first]
        if h.program_id:
            sessions += [core.kv.sessions[sid] for sid in core.kv.programs.get(h.program_id, ())]
        for s in sessions:
            s.program_start_s = now - h.program_age_s
            s.priority_class = h.priority_class
        core.scheduler.mark_priorities_changed()
        return HintResult(index=i)
    if isinstance(h, Prefetch):
        core.kv.set_prefetch(core._session(h.session_id), h.at_s)
        return HintResult(index=i)
    if isinstance(h, Expect):
        core._session(h.session_id).expected_output_tokens = h.output_tokens
        return HintResult(index=i)
    if isinstance(h, Release):
        if h.program_id not in core.kv.programs:
            raise NotFound(f"unknown program {h.program_id!r} on node {core.node_id}")
        core.kv.release_program(h.program_id)
        return HintResult(index=i)
    raise InvalidArgument(f"unsupported hint {type(h).__name__}")
