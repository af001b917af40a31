"""hintflow's ``EngineNode.PushHints`` / ``WatchCacheState`` / ``GetCacheState`` served from inside vLLM's
engine-core process, and (with ``HINTFLOW_METRICS_PORT``) the node's ``hintflow_*`` Prometheus metrics.

Why inside: the scheduler's blocks and queues live in that process, so a hint applied there takes effect
on the next step with no extra hop and no second copy of state to drift. A plain thread-pool gRPC server
(not grpc.aio: the engine-core process runs vLLM's busy loop, not an event loop of ours) applies each
batch under the scheduler's ``hint_lock``, the same lock ``schedule()`` holds, so a hint lands between two
steps. Per-hint results follow the embedded node (``engine_adapter._engine``): NOT_FOUND for an unknown
session or program, INVALID_ARGUMENT for a hint that does not decode, and a bad hint never ends the
stream. Other RPCs of the service (Generate, export/import) answer UNIMPLEMENTED: requests go through
vLLM's OpenAI server.

``GetCacheState`` / ``WatchCacheState`` answer from ``_cache_state`` (the state, its version and the watch
contract). Each open stream holds one thread of the server's pool (``MAX_WORKERS``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from hints import (
    EvictionOrder,
    Expect,
    HintAck,
    HintDecodeError,
    HintModel,
    HintResult,
    Pin,
    Prefetch,
    Priority,
    Release,
    ack_to_proto,
    batch_from_proto_lenient,
    cache_state_to_proto,
    engine_pb2_grpc,
    stale_batch_results,
)

from ._cache_state import SchedulerStateVersion, serve_watch
from ._metrics import HintStats, MetricsServer, start_metrics_server

if TYPE_CHECKING:
    from ._hint_scheduler import HintSchedulerMixin

__all__ = [
    "MAX_WORKERS",
    "HintServer",
    "apply_hints",
    "bind_engine_node",
    "start_hint_server",
]

MAX_WORKERS = 32
"""Threads of the hint server: each open PushHints or WatchCacheState stream holds one (a worker process
of the orchestrator opens one of each per node), so a few workers must not exhaust the pool."""

log = logging.getLogger(__name__)


def bind_engine_node(servicer: Any, host: str, port: int, what: str, thread_prefix: str) -> tuple[grpc.Server, int]:
    """A not yet started gRPC server with ``servicer`` as ``hintflow.v1.EngineNode`` on ``host:port`` (0: a
    free port) and a pool of :data:`MAX_WORKERS` threads; (server, bound port). OSError naming ``what``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix=thread_prefix))
    engine_pb2_grpc.add_EngineNodeServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"hintflow: cannot bind the {what} to {host}:{port}")
    return server, bound


class _Error(Exception):
    code = "INTERNAL"


class _NotFound(_Error):
    code = "NOT_FOUND"


class _Invalid(_Error):
    code = "INVALID_ARGUMENT"


def apply_hints(sched: HintSchedulerMixin, hints: Sequence[HintModel | HintDecodeError]) -> list[HintResult]:
    """Apply a batch in order under the scheduler lock; one result per hint."""
    results = []
    with sched.hint_lock:
        sched.book.expire()  # an idle engine does not step: leases must still run out on time
        for i, h in enumerate(hints):
            if sched.infer is not None:  # the orchestrator speaks for these sessions: no inferred pins
                for sid in _sessions_named(h):
                    sched.infer.note_explicit(sid)
            try:
                results.append(_apply(sched, i, h))
            except _Error as e:
                results.append(HintResult(index=i, code=e.code, message=str(e)[:4000]))
    return results


def _sessions_named(h: HintModel | HintDecodeError) -> list[str]:
    if isinstance(h, EvictionOrder):
        return [e.session_id for e in h.entries]
    sid = getattr(h, "session_id", "")
    return [sid] if isinstance(sid, str) and sid else []


def _session(sched: HintSchedulerMixin, session_id: str) -> Any:
    s = sched.book.sessions.get(session_id)
    if s is None:
        raise _NotFound(f"unknown session {session_id!r} on node {sched.node_id}")
    return s


def _apply(sched: HintSchedulerMixin, i: int, h: HintModel | HintDecodeError) -> HintResult:
    book = sched.book
    if isinstance(h, HintDecodeError):
        raise _Invalid(str(h))
    if isinstance(h, Pin):
        s = _session(sched, h.session_id)
        s.pin_hinted_s = book.clock()
        g = book.set_pin(s, h.ttl_s)
        msg = "pin applies when the running turn ends" if g.deferred else ""
        if g.clamped:
            msg = f"pin clamped to {g.pinned_blocks} of {g.requested_blocks} blocks"
        if not sched.pins_supported:
            msg = "recorded only: this vLLM configuration cannot hold blocks (see the node's log)"
        return HintResult(
            index=i,
            message=msg,
            clamped=g.clamped,
            pinned_blocks=g.pinned_blocks,
            requested_blocks=g.requested_blocks,
        )
    if isinstance(h, Release):
        if h.program_id not in book.programs:
            raise _NotFound(f"unknown program {h.program_id!r} on node {sched.node_id}")
        book.release_program(h.program_id)
        return HintResult(index=i)
    if isinstance(h, Priority):
        # As on the embedded node (engine_adapter/_hint_enforcement.py): with its program named, a turn's
        # Priority that comes before the turn records the session, so the turn queues in its program's place.
        first = book.session(h.session_id, h.program_id) if h.program_id else _session(sched, h.session_id)
        if h.program_id and first.program_id != h.program_id:
            raise _Invalid(f"session {h.session_id!r} belongs to program {first.program_id!r}, not {h.program_id!r}")
        sessions = [first]
        if h.program_id:
            sessions += [book.sessions[sid] for sid in book.programs.get(h.program_id, ())]
        now = book.clock()
        for s in sessions:
            s.program_start_s = now - h.program_age_s
            s.priority_class = h.priority_class
            sched.reprioritize(s)
        msg = "" if sched.policy.name == "PRIORITY" else "recorded: vLLM runs with --scheduling-policy fcfs"
        return HintResult(index=i, message=msg)
    if isinstance(h, EvictionOrder):
        unknown = []
        now = book.clock()
        known = []
        for e in h.entries:
            s = book.sessions.get(e.session_id)
            if s is None:
                unknown.append(e.session_id)
            else:
                s.next_use_deadline_s = now + e.next_use_s
                known.append(s)
        if sched.pins_supported:
            book.place_by_next_use(known)
        if unknown:
            raise _NotFound(
                f"{len(unknown)} unknown session(s), e.g. {unknown[0]!r}; the others were applied"
            )
        return HintResult(index=i)
    if isinstance(h, Prefetch):
        s = _session(sched, h.session_id)
        s.next_use_deadline_s = book.clock() + h.at_s
        if getattr(sched, "host_tier", None) is not None:
            msg = "recorded as a next use: the host tier loads a context when its turn is admitted, not ahead"
        else:
            msg = "no host tier on this node: recorded as a next use"
        return HintResult(index=i, message=msg)
    if isinstance(h, Expect):
        _session(sched, h.session_id).expected_output_tokens = h.output_tokens
        return HintResult(index=i)
    raise _Invalid(f"unsupported hint {type(h).__name__}")


class _Servicer(engine_pb2_grpc.EngineNodeServicer):  # type: ignore[misc]
    def __init__(
        self,
        sched: HintSchedulerMixin,
        *,
        watch_interval_s: float = 1.0,
        watch_min_period_s: float = 0.05,
    ) -> None:
        self.sched = sched
        self.stats = HintStats()
        self.states = SchedulerStateVersion(sched)
        self.watch_interval_s = watch_interval_s
        self.watch_min_period_s = watch_min_period_s
        self.closing = threading.Event()

    def PushHints(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for batch in request_iterator:
            yield self._apply_batch(batch)

    def _apply_batch(self, batch: Any) -> Any:
        try:
            decoded = batch_from_proto_lenient(batch)
            epoch = self.sched.node_epoch
            stale = stale_batch_results(decoded.node_epoch, epoch, len(decoded.hints))
            results = stale if stale is not None else apply_hints(self.sched, decoded.hints)
            self.states.hints_applied()
            self.stats.count(decoded.hints, results)
            if decoded.sent_unix_s > 0:
                self.stats.observe_delivery(time.time() - decoded.sent_unix_s)
            return ack_to_proto(HintAck(batch_id=decoded.batch_id, results=results, node_epoch=epoch))
        except Exception as e:  # an engine bug still answers the batch rather than ending the stream
            log.exception("applying hint batch %d failed", batch.batch_id)
            results = [
                HintResult(index=i, code="INTERNAL", message=f"{type(e).__name__}: {e}"[:4000])
                for i in range(len(batch.hints))
            ]
            return ack_to_proto(HintAck(batch_id=batch.batch_id, results=results, node_epoch=self.sched.node_epoch))

    def GetCacheState(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cache_state_to_proto(self.states.state(request.include_sessions))

    def WatchCacheState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from serve_watch(
            self.states, request, context, self.watch_interval_s, self.watch_min_period_s, self.closing
        )


@dataclass
class HintServer:
    server: grpc.Server
    port: int
    servicer: _Servicer
    metrics: MetricsServer | None = None

    @property
    def stats(self) -> HintStats:
        return self.servicer.stats

    def stop(self) -> None:
        self.servicer.closing.set()  # ends watch streams now rather than after the grace
        self.server.stop(grace=0.5)
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None


def start_hint_server(
    sched: HintSchedulerMixin, port: int, host: str = "127.0.0.1", metrics_port: int | None = None
) -> HintServer:
    """Serve the hint service on ``host:port`` (0: a free port) from a thread pool.

    ``metrics_port`` (None: ``$HINTFLOW_METRICS_PORT``, unset or -1: none; 0: a free port) also serves
    ``/metrics`` on ``$HINTFLOW_METRICS_HOST`` (default ``host``); see ``_metrics``.
    """
    servicer = _Servicer(sched)
    server, bound = bind_engine_node(servicer, host, port, "hint service", "hintflow-hints")
    if metrics_port is None:
        metrics_port = int(os.environ.get("HINTFLOW_METRICS_PORT", "-1") or "-1")
    metrics = None
    if metrics_port >= 0:
        mhost = os.environ.get("HINTFLOW_METRICS_HOST", host)
        metrics = start_metrics_server(sched, metrics_port, mhost, servicer.stats)
        log.info("hintflow metrics on http://%s:%d/metrics", mhost, metrics.port)
    server.start()
    return HintServer(server, bound, servicer, metrics)
