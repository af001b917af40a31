"""A vLLM node's ``CacheState`` under hintflow's scheduler, its version, and the ``WatchCacheState`` stream.

:func:`cache_state` reads the node's state in the protocol's terms under the scheduler's ``hint_lock``.
``WatchCacheState`` follows the embedded node's contract (the state now, then on change at most every
``watch_min_period_s`` and at least every ``interval_s``), so ``HintRuntime``'s router reads a vLLM node
as it reads an embedded one. vLLM keeps no state version, so :class:`SchedulerStateVersion` makes one: a
counter that moves when a cheap signature of the node (free and pinned blocks, queue lengths, backlog,
sessions, hints applied) changes; it starts again at 1 when the node restarts, which is how the router
tells a restart. :func:`watch_cache_states` / :func:`serve_watch` stream any :class:`CacheStateSource`.

Separate from ``_hint_service`` (which applies hints and runs the gRPC server) because this is the read
side: what the node reports and when. The stock-vLLM sidecar (``_kv_sidecar``) streams its own source
through the same :func:`serve_watch`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from pydantic import ValidationError

from hints import CacheState, SessionResidency, cache_state_to_proto, residency_reported

if TYPE_CHECKING:
    from ._hint_scheduler import HintSchedulerMixin

__all__ = [
    "CacheStateSource",
    "SchedulerStateVersion",
    "cache_state",
    "serve_watch",
    "watch_cache_states",
]


def cache_state(sched: HintSchedulerMixin, include_sessions: bool, version: int = 0) -> CacheState:
    """The node's state in the protocol's terms, read under the scheduler lock."""
    with sched.hint_lock:
        sched.expire_pins()
        pool = sched.kv_cache_manager.block_pool
        bs = sched.block_size
        tier = getattr(sched, "host_tier", None)  # hintflow's host KV tier, when vLLM runs it
        sessions = []
        if include_sessions:
            for s in sched.book.sessions.values():
                device = s.resident_blocks() * bs
                host = tier.session_host_tokens(s.session_id) if tier is not None else 0
                if not residency_reported(device, host, s.state):
                    continue
                try:
                    residency = SessionResidency(
                        session_id=s.session_id,
                        program_id=s.program_id,
                        device_tokens=device,
                        host_tokens=host,
                        pinned=bool(s.held) and not s.queue_hold,  # a queue hold is no pin
                        state=s.state,  # type: ignore[arg-type]
                    )
                except ValidationError:
                    # ids the protocol cannot carry (the scheduler does not admit them to the book, but one
                    # such session must never cost the node its whole cache state)
                    continue
                sessions.append(residency)
        return CacheState(
            node_id=sched.node_id,
            model_name=sched.model_name,
            block_size=bs,
            total_blocks=sched.book.num_blocks,
            free_blocks=pool.get_num_free_blocks(),
            pinned_blocks=sched.book.num_pinned_blocks,
            host_total_blocks=tier.index.num_slots if tier is not None else 0,
            host_free_blocks=tier.index.num_slots - tier.index.num_used_slots if tier is not None else 0,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            prefill_backlog_tokens=sched.prefill_backlog_tokens(),
            sessions=sessions,
            node_time_s=sched.book.clock(),
            version=version,
            host_reload_s_per_token=float(getattr(sched, "host_reload_s_per_token", 0.0)),
            host_hit_fraction=sched.host_hits.fraction() if tier is not None else 0.0,
            node_epoch=sched.node_epoch,
            prefill_share=min(1.0, sched.prefill_share.fraction()),
            unpinned_survival=sched.unpinned_survival.fraction(),
        )


class CacheStateSource(Protocol):
    """What ``WatchCacheState`` streams: a state (carrying its version) and a cheap current version."""

    def state(self, include_sessions: bool) -> CacheState: ...

    def version(self) -> int: ...


class SchedulerStateVersion:
    """A version for a vLLM node's cache state: bumps when a cheap signature of the node changes."""

    def __init__(self, sched: HintSchedulerMixin) -> None:
        self.sched = sched
        self._lock = threading.Lock()
        self._signature: tuple[int, ...] | None = None
        self._version = 0
        self._hint_batches = 0

    def hints_applied(self) -> None:
        with self._lock:
            self._hint_batches += 1

    def _current(self) -> tuple[int, ...]:
        """Called under the scheduler lock."""
        sched = self.sched
        return (
            sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            sched.book.num_pinned_blocks,
            len(sched.waiting),
            len(sched.running),
            sched.prefill_backlog_tokens(),
            len(sched.book.sessions),
        )

    def _observe(self, signature: tuple[int, ...]) -> int:
        with self._lock:
            signature = (*signature, self._hint_batches)
            if signature != self._signature:
                self._signature = signature
                self._version += 1
            return self._version

    def version(self) -> int:
        with self.sched.hint_lock:
            self.sched.expire_pins()
            signature = self._current()
        return self._observe(signature)

    def state(self, include_sessions: bool) -> CacheState:
        with self.sched.hint_lock:
            self.sched.expire_pins()
            version = self._observe(self._current())
            return cache_state(self.sched, include_sessions, version)


def watch_cache_states(
    source: CacheStateSource,
    include_sessions: bool,
    interval_s: float,
    min_period_s: float,
    closing: threading.Event,
    active: Callable[[], bool] = lambda: True,
) -> Iterator[CacheState]:
    """The state now, then whenever its version moves (checked every ``min_period_s``) and at least every
    ``interval_s``, until ``closing`` is set or ``active()`` turns false (the client went away)."""
    while not closing.is_set() and active():
        state = source.state(include_sessions)
        yield state
        sent_at = time.monotonic()
        while not closing.is_set() and active():
            left = sent_at + interval_s - time.monotonic()
            if left <= 0:
                break
            closing.wait(min(min_period_s, left))
            if source.version() != state.version:
                break


def serve_watch(
    source: CacheStateSource,
    request: Any,
    context: grpc.ServicerContext,
    default_interval_s: float,
    min_period_s: float,
    closing: threading.Event,
) -> Iterator[Any]:
    """``WatchCacheState`` on a sync gRPC server: validate the interval, then stream protos."""
    interval = request.interval_s
    if not math.isfinite(interval) or interval < 0:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"interval_s must be >= 0, got {interval}")
    interval = max(interval or default_interval_s, min_period_s)
    for state in watch_cache_states(
        source, request.include_sessions, interval, min_period_s, closing, context.is_active
    ):
        yield cache_state_to_proto(state)
