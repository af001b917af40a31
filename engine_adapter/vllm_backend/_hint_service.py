"""hintflow's ``EngineNode.PushHints`` / ``WatchCacheState`` / ``GetCacheState`` served from inside vLLM's
engine-core process, and (with ``HINTFLOW_METRICS_PORT``) the node's ``hintflow_*`` Prometheus metrics.

Why inside: the scheduler's blocks and queues live in that process, so a hint applied there takes effect
on the next step with no extra hop and no second copy of state to drift. A plain thread-pool gRPC server
(not grpc.aio: the engine-core process runs vLLM's busy loop, not an event loop of ours) applies each
batch under the scheduler's ``hint_lock``, the same lock ``schedule()`` holds, so a hint lands between two
steps. Per-hint results follow the embedded node (``engine_adapter._engine``): NOT_FOUND for an unknown
session or program, INVALID_ARGUMENT for a hint that does not decode, and a bad hint never ends the
stream. ``ExportContext`` / ``ImportContext`` / ``DropContext`` move a parked session's context between
vLLM nodes (``_context_moves``: what moves, the leases, and when a node refuses); ``Generate`` answers
UNIMPLEMENTED: requests go through vLLM's OpenAI server.

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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from engine_adapter._context_blocks import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    header_from_proto,
    header_to_proto,
)
from engine_adapter._engine_errors import EngineError, InvalidArgument
from engine_adapter._hint_semantics import apply_hint
from hints import (
    IMPORT_ACK_KEY,
    EvictionOrder,
    HintAck,
    HintDecodeError,
    HintModel,
    HintResult,
    ack_to_proto,
    batch_from_proto_lenient,
    cache_state_to_proto,
    engine_pb2,
    engine_pb2_grpc,
    stale_batch_results,
)

from ._cache_state import SchedulerStateVersion, serve_watch
from ._context_moves import begin_export, begin_import, drop_exported
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


class _VllmTarget:
    """The vLLM node's session book and scheduler as a ``HintTarget`` (``engine_adapter._hint_semantics``,
    the meaning of each hint, shared with the embedded node)."""

    def __init__(self, sched: HintSchedulerMixin) -> None:
        self.sched, self.book, self.node_id = sched, sched.book, sched.node_id

    def now(self) -> float:
        return float(self.book.clock())

    def find(self, session_id: str) -> Any:
        return self.book.sessions.get(session_id)

    def record(self, session_id: str, program_id: str) -> Any:
        return self.book.session(session_id, program_id)

    def program_of(self, s: Any) -> str:
        return str(s.program_id)

    def sessions_of(self, program_id: str) -> list[Any] | None:
        ids = self.book.programs.get(program_id)
        if ids is None:
            return None
        return [s for sid in ids if (s := self.book.sessions.get(sid)) is not None]

    def pin(self, s: Any, ttl_s: float) -> Any:
        s.pin_hinted_s = self.book.clock()
        return self.book.set_pin(s, ttl_s)

    def pin_note(self) -> str:
        if self.sched.pins_supported:
            return ""
        return "recorded only: this vLLM configuration cannot hold blocks (see the node's log)"

    def release(self, program_id: str) -> None:
        self.book.release_program(program_id)

    def prioritize(self, sessions: list[Any], start_s: float, priority_class: int) -> None:
        for s in sessions:
            s.program_start_s = start_s
            s.priority_class = priority_class
            self.sched.reprioritize(s)

    def priority_note(self) -> str:
        return "" if self.sched.policy.name == "PRIORITY" else "recorded: vLLM runs with --scheduling-policy fcfs"

    def next_use(self, known: list[tuple[Any, float]]) -> None:
        now = self.book.clock()
        for s, next_use_s in known:
            s.next_use_deadline_s = now + next_use_s
        if self.sched.pins_supported:
            self.book.place_by_next_use([s for s, _ in known])

    def prefetch(self, s: Any, at_s: float) -> str:
        s.next_use_deadline_s = self.book.clock() + at_s
        if getattr(self.sched, "host_tier", None) is not None:
            return "recorded as a next use: the host tier loads a context when its turn is admitted, not ahead"
        return "no host tier on this node: recorded as a next use"

    def expect(self, s: Any, output_tokens: int) -> None:
        s.expected_output_tokens = output_tokens


def apply_hints(sched: HintSchedulerMixin, hints: Sequence[HintModel | HintDecodeError]) -> list[HintResult]:
    """Apply a batch in order under the scheduler lock; one result per hint."""
    results = []
    target = _VllmTarget(sched)
    with sched.hint_lock:
        sched.expire_pins()  # an idle engine does not step: leases must still run out on time
        for i, h in enumerate(hints):
            if sched.infer is not None:  # the orchestrator speaks for these sessions: no inferred pins
                for sid in _sessions_named(h):
                    sched.infer.note_explicit(sid)
            try:
                results.append(apply_hint(target, i, h))
            except EngineError as e:
                results.append(HintResult(index=i, code=e.code, message=str(e)[:4000]))
    return results


def _sessions_named(h: HintModel | HintDecodeError) -> list[str]:
    if isinstance(h, EvictionOrder):
        return [e.session_id for e in h.entries]
    sid = getattr(h, "session_id", "")
    return [sid] if isinstance(sid, str) and sid else []


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

    def ExportContext(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with _status(context):
            if request.chunk_bytes < 0:
                raise InvalidArgument(f"chunk_bytes must be >= 0, got {request.chunk_bytes}")
            export = begin_export(self.sched, request.session_id, min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES))
            try:
                yield engine_pb2.ContextChunk(header=header_to_proto(export.header))
                while (chunk := export.read_chunk()) is not None:
                    yield engine_pb2.ContextChunk(kv_data=chunk[0], num_blocks=chunk[1])
            finally:  # ended, failed or cancelled: the lease goes
                export.close()

    def ImportContext(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        with _status(context):
            first = next(request_iterator, None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("the first chunk of ImportContext must carry the context's header")
            header = header_from_proto(first.header)
            imp = begin_import(self.sched, header)
            try:
                context.send_initial_metadata(((IMPORT_ACK_KEY, "reserved"),))  # the blocks are reserved
                msg: Any = first
                while msg is not None:
                    if msg is not first and msg.HasField("header"):
                        raise InvalidArgument("only the first chunk of ImportContext may carry a header")
                    if msg.kv_data or msg.num_blocks:
                        imp.write_chunk(msg.kv_data, msg.num_blocks)
                    msg = next(request_iterator, None)
                num_tokens, num_blocks, pinned = imp.commit()
            finally:  # no-op once committed; else every reserved block goes back
                imp.abort()
            self.states.hints_applied()  # the cache state changed: watchers hear of it
            return engine_pb2.ImportContextResponse(
                session_id=header.session_id, num_tokens=num_tokens, num_blocks=num_blocks, pinned_blocks=pinned
            )

    def DropContext(self, request: Any, context: grpc.ServicerContext) -> Any:
        with _status(context):
            dropped, reason = drop_exported(self.sched, request.session_id, request.num_tokens)
            self.states.hints_applied()
            return engine_pb2.DropContextResponse(dropped=dropped, reason=reason)

    def GetCacheState(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cache_state_to_proto(self.states.state(request.include_sessions))

    def WatchCacheState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from serve_watch(
            self.states, request, context, self.watch_interval_s, self.watch_min_period_s, self.closing
        )


@contextmanager
def _status(context: grpc.ServicerContext) -> Iterator[None]:
    """An EngineError ends the call with its own status code, anything else with INTERNAL."""
    try:
        yield
    except EngineError as e:
        context.abort(grpc.StatusCode[e.code], str(e)[:4000])
    except grpc.RpcError:
        raise  # (context.abort's own exception, or the peer went away)
    except Exception as e:
        log.exception("a context move failed on this node")
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"[:4000])


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
