"""The engine node's gRPC face (``hintflow.v1.EngineNode`` on grpc.aio), plus health, reflection, metrics.

The event loop only moves messages; the engine steps in its own thread (``EngineCore.start``).  Tokens
cross from that thread to a ``Generate`` stream through ``loop.call_soon_threadsafe`` into an
``asyncio.Queue``.  Hints are applied directly on the loop: ``apply_hints`` is a few dictionary updates
under the engine lock, and applying before acknowledging means an ack already reflects the hint.

Context moves are streams, so that neither end ever holds a whole context (one of 100k tokens of an 8B
model is gigabytes): ``ExportContext`` leases the session and sends a header, then one chunk of whole
blocks at a time (at most ``chunk_bytes``), each read in a worker thread under the engine's exclusive lock
just before it is sent; ``ImportContext`` checks the header, reserves every block, writes each chunk as it
arrives and commits at the end of the stream; ``DropContext`` is a move's second phase at the source.
Each stream lets go of what it holds in a ``finally`` (the export's lease, the import's reserved blocks)
when it ends, fails, is cancelled or its peer vanishes, and a peer that stops reading or sending for
``transfer_stall_s`` ends it too (DEADLINE_EXCEEDED), so no stuck peer holds a session.

Errors: an ``EngineError`` becomes its own status code (``.code`` is the gRPC name); anything else is
INTERNAL with the exception's message, and the node keeps serving.  A bad hint is answered in its
``HintResult`` and never ends a ``PushHints`` stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from pydantic import TypeAdapter, ValidationError

from hints import (
    IMPORT_ACK_KEY,
    HintAck,
    HintResult,
    OptionalProgramId,
    SessionId,
    ack_to_proto,
    batch_from_proto_lenient,
    cache_state_to_proto,
    engine_pb2,
    engine_pb2_grpc,
    stale_batch_results,
)

from ._context_blocks import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, header_from_proto, header_to_proto
from ._engine import EngineCore, EngineError, InvalidArgument
from ._metrics import EngineMetrics
from ._scheduler import Request

__all__ = ["MAX_MESSAGE_BYTES", "EngineNodeServicer", "RunningNode", "start_node"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Send/receive limit: a context chunk holds up to 64 MiB of KV, and the header of a context of a million
tokens about 10 MB of token ids, both over gRPC's 4 MiB."""

TRANSFER_STALL_S = 30.0
"""A context stream whose peer neither takes nor sends a message for this long is ended (see the docstring)."""

_T = TypeVar("_T")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineNode"].full_name
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


_SESSION_ID: TypeAdapter[str] = TypeAdapter(SessionId)
_PROGRAM_ID: TypeAdapter[str] = TypeAdapter(OptionalProgramId)


def _check_ids(request: engine_pb2.GenerateRequest) -> None:
    """Ids follow the protocol's rules (length, no control characters) before they enter the engine.

    Otherwise one odd id, accepted here, would make every later CacheState with sessions fail to validate.
    """
    for what, adapter, value in (
        ("session_id", _SESSION_ID, request.session_id),
        ("program_id", _PROGRAM_ID, request.program_id),
    ):
        try:
            adapter.validate_python(value)
        except ValidationError as e:
            raise InvalidArgument(f"{what}: {e.errors()[0]['msg']}") from None


class _Event(NamedTuple):
    """What the step thread hands a Generate stream: new tokens, and the request's accounting then."""

    tokens: list[int]
    finished: bool
    finish_reason: str
    first: engine_pb2.GenerateResponse | None  # the first event: accounting, read under the engine lock


def _accounting(req: Request) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(
        request_id=req.request_id,
        num_prompt_tokens=len(req.prompt),
        num_cached_tokens=req.num_cached_tokens,
        num_host_hit_tokens=req.num_host_hit_tokens,
        num_recomputed_tokens=req.num_recomputed_tokens,
        queue_wait_s=req.queue_wait_s,
        ttft_s=req.ttft_s or 0.0,
    )


@contextlib.asynccontextmanager
async def _status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Turn exceptions into gRPC statuses: EngineError keeps its code, the rest are INTERNAL."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except EngineError as e:
        await context.abort(grpc.StatusCode[e.code], str(e))
    except Exception as e:
        log.exception("unexpected error in an EngineNode handler")
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class EngineNodeServicer(engine_pb2_grpc.EngineNodeServicer):
    """Serves one EngineCore; see the module docstring for the threading and error rules."""

    def __init__(
        self,
        core: EngineCore,
        metrics: EngineMetrics | None = None,
        *,
        watch_interval_s: float = 1.0,
        watch_min_period_s: float = 0.05,
        transfer_stall_s: float = TRANSFER_STALL_S,
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.watch_interval_s = watch_interval_s
        self.watch_min_period_s = watch_min_period_s
        self.transfer_stall_s = transfer_stall_s
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End open WatchCacheState streams now, so that a graceful stop need not wait out its grace."""
        self._closing.set()

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        async with _status(context):
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[_Event] = asyncio.Queue()
            no_events_yet = True

            def on_event(req: Request, tokens: list[int], finished: bool) -> None:
                nonlocal no_events_yet  # step thread only, one event at a time
                first = _accounting(req) if no_events_yet else None
                no_events_yet = False
                with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
                    loop.call_soon_threadsafe(
                        queue.put_nowait, _Event(list(tokens), finished, req.finish_reason, first)
                    )

            _check_ids(request)
            req = self.core.submit(
                list(request.prompt_token_ids),
                request.max_new_tokens,
                session_id=request.session_id,
                program_id=request.program_id,
                request_id=request.request_id,
                priority=request.priority if request.HasField("priority") else None,
                stop_token_ids=list(request.stop_token_ids),
                on_event=on_event,
            )
            finished = False
            try:
                while not finished:
                    event = await queue.get()
                    msg = event.first or engine_pb2.GenerateResponse()
                    msg.token_ids.extend(event.tokens)
                    while not event.finished and not queue.empty():  # coalesce what piled up
                        event = queue.get_nowait()
                        msg.token_ids.extend(event.tokens)
                    finished = msg.finished = event.finished
                    msg.finish_reason = event.finish_reason
                    if finished and event.finish_reason == "abort":  # we did not cancel: a step failed
                        err = self.core.step_error
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine step failed: {err!r}")
                    yield msg
            finally:
                if not finished:  # the client went away (or the node stops): free the slot now
                    self.core.abort(req.request_id)

    async def PushHints(
        self, request_iterator: AsyncIterator[engine_pb2.HintBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.HintAck]:
        async for batch in request_iterator:
            yield self._apply_batch(batch)

    def _apply_batch(self, batch: engine_pb2.HintBatch) -> engine_pb2.HintAck:
        """Decode leniently and apply; even an engine bug answers this batch rather than ending the stream."""
        try:
            decoded = batch_from_proto_lenient(batch)
            epoch = self.core.node_epoch
            stale = stale_batch_results(decoded.node_epoch, epoch, len(decoded.hints))
            results = stale if stale is not None else self.core.apply_hints(decoded.hints)
            if self.metrics is not None:
                self.metrics.observe_hint_delivery(decoded.sent_unix_s)
            return ack_to_proto(HintAck(batch_id=decoded.batch_id, results=results, node_epoch=epoch))
        except Exception as e:
            log.exception("applying hint batch %d failed", batch.batch_id)
            msg = f"{type(e).__name__}: {e}"[:4000]
            results = [HintResult(index=i, code="INTERNAL", message=msg) for i in range(len(batch.hints))]
            return ack_to_proto(HintAck(batch_id=batch.batch_id, results=results, node_epoch=self.core.node_epoch))

    async def WatchCacheState(
        self, request: engine_pb2.WatchCacheStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.CacheState]:
        async with _status(context):
            interval = request.interval_s
            if not math.isfinite(interval) or interval < 0:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"interval_s must be >= 0, got {interval}"
                )
            interval = max(interval or self.watch_interval_s, self.watch_min_period_s)
            while not self._closing.is_set():
                state = self.core.cache_state(request.include_sessions)
                yield cache_state_to_proto(state)
                sent_at = time.monotonic()
                # Poll the version: cheaper than a wakeup per step, and caps the rate at 1/min_period.
                while not self._closing.is_set():
                    left = sent_at + interval - time.monotonic()
                    if left <= 0:
                        break
                    await asyncio.sleep(min(self.watch_min_period_s, left))
                    if self.core.version != state.version:
                        break

    async def GetCacheState(
        self, request: engine_pb2.WatchCacheStateRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.CacheState:
        async with _status(context):
            return cache_state_to_proto(self.core.cache_state(request.include_sessions))
        raise AssertionError("unreachable: _status aborts")

    async def ExportContext(
        self, request: engine_pb2.ExportContextRequest, context: grpc.aio.ServicerContext
    ) -> None:
        async with _status(context):
            if request.chunk_bytes < 0:
                raise InvalidArgument(f"chunk_bytes must be >= 0, got {request.chunk_bytes}")
            chunk_bytes = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
            export = await _owned(
                lambda: self.core.begin_export(request.session_id, chunk_bytes), lambda e: e.close()
            )
            try:
                await self._send(context, engine_pb2.ContextChunk(header=header_to_proto(export.header)))
                while (chunk := await asyncio.to_thread(export.read_chunk)) is not None:
                    data, num_blocks = chunk
                    await self._send(context, engine_pb2.ContextChunk(kv_data=data, num_blocks=num_blocks))
            finally:  # the stream ended, failed or was cancelled: the session is free to evict, run or move
                await _to_the_end(export.close)

    async def ImportContext(
        self, request_iterator: AsyncIterator[engine_pb2.ContextChunk], context: grpc.aio.ServicerContext
    ) -> engine_pb2.ImportContextResponse:
        async with _status(context):
            first = await self._receive(context)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("the first chunk of ImportContext must carry the context's header")
            header = header_from_proto(first.header)
            imp = await _owned(lambda: self.core.begin_import(header), lambda i: i.abort())
            try:
                # The header's ack: the blocks are reserved, so the mover may stream the KV now.  A refusal
                # ends the call instead, and the mover (which waits for this before its first chunk) gets
                # the refusal's own code, not a write failing against a finished call.
                await context.send_initial_metadata(((IMPORT_ACK_KEY, "reserved"),))
                msg: engine_pb2.ContextChunk | None = first
                while msg is not None:
                    if msg is not first and msg.HasField("header"):
                        raise InvalidArgument("only the first chunk of ImportContext may carry a header")
                    if msg.kv_data or msg.num_blocks:
                        await asyncio.to_thread(imp.write_chunk, msg.kv_data, msg.num_blocks)
                    msg = await self._receive(context)
                num_tokens, num_blocks, pinned = await asyncio.to_thread(imp.commit)
            finally:  # no-op once committed; else every reserved block goes back
                await _to_the_end(imp.abort)
            return engine_pb2.ImportContextResponse(
                session_id=header.session_id,
                num_tokens=num_tokens,
                num_blocks=num_blocks,
                pinned_blocks=pinned,
            )
        raise AssertionError("unreachable: _status aborts")

    async def DropContext(
        self, request: engine_pb2.DropContextRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DropContextResponse:
        async with _status(context):  # (frees blocks under the lock, as a Release does: on the loop)
            dropped, reason = self.core.drop_exported(request.session_id, request.num_tokens)
            return engine_pb2.DropContextResponse(dropped=dropped, reason=reason)
        raise AssertionError("unreachable: _status aborts")

    async def _send(self, context: grpc.aio.ServicerContext, msg: engine_pb2.ContextChunk) -> None:
        try:
            await asyncio.wait_for(context.write(msg), self.transfer_stall_s)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the reader took no chunk for {self.transfer_stall_s:g} s"
            )

    async def _receive(self, context: grpc.aio.ServicerContext) -> engine_pb2.ContextChunk | None:
        """The next chunk, or None at the end of the stream."""
        try:
            msg = await asyncio.wait_for(context.read(), self.transfer_stall_s)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the sender sent no chunk for {self.transfer_stall_s:g} s"
            )
        return None if msg is grpc.aio.EOF else msg


async def _owned(begin: Callable[[], _T], end: Callable[[_T], None]) -> _T:
    """``begin()`` in a worker thread; if the caller is cancelled while it runs, ``end`` what it returns
    once it has (a lease taken for a stream that is already gone must not be held forever)."""
    handoff = threading.Lock()
    abandoned = False
    done: list[_T] = []

    def run() -> _T:
        value = begin()
        with handoff:
            if not abandoned:
                done.append(value)
                return value
        end(value)
        return value

    try:
        return await asyncio.to_thread(run)
    except asyncio.CancelledError:
        with handoff:
            abandoned = True
        for value in done:  # it finished, but the result never reached us
            end(value)
        raise


async def _to_the_end(fn: Callable[[], None]) -> None:
    """Run a cleanup in a worker thread (it may wait for a step); a second cancellation does not stop it."""
    await asyncio.shield(asyncio.to_thread(fn))


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class RunningNode:
    """A serving node: gRPC server, engine step thread, and (optionally) the Prometheus HTTP server."""

    core: EngineCore
    server: grpc.aio.Server
    servicer: EngineNodeServicer
    health: health.aio.HealthServicer
    metrics: EngineMetrics
    host: str
    port: int
    metrics_port: int | None  # None: no metrics server
    _http: tuple[Any, threading.Thread] | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return _join(self.host, self.port)

    @property
    def metrics_address(self) -> str | None:
        return None if self.metrics_port is None else _join(self.host, self.metrics_port)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Say NOT_SERVING, end watch streams, let RPCs finish for ``grace`` s, then stop the engine."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        self.servicer.close()
        await self.server.stop(grace)
        if self._http is not None:
            httpd, thread = self._http
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)
        await asyncio.to_thread(self.core.stop)


async def start_node(
    core: EngineCore, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = 0
) -> RunningNode:
    """Serve ``core`` on ``host:port`` (0: a free port); metrics on ``metrics_port`` (0: free, -1/None: off)."""
    metrics = EngineMetrics.of(core)
    server = grpc.aio.server(options=_OPTIONS)
    servicer = EngineNodeServicer(core, metrics)
    engine_pb2_grpc.add_EngineNodeServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(_join(host, port))
    except RuntimeError as e:
        raise OSError(f"cannot bind {_join(host, port)}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot bind {_join(host, port)}")
    http = None
    if metrics_port is not None and metrics_port >= 0:
        http = start_http_server(metrics_port, addr=host, registry=metrics.registry)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    core.start()
    try:
        await server.start()
    except BaseException:
        core.stop()
        if http is not None:
            http[0].shutdown()
            http[0].server_close()
        raise
    mport = http[0].server_port if http is not None else None
    return RunningNode(core, server, servicer, health_servicer, metrics, host, bound, mport, http)
