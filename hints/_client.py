"""An asyncio client for one engine node (``hintflow.v1.EngineNode``), speaking the models of ``hints``.

Hints go over one long-lived ``PushHints`` stream, opened on first use: a stream keeps batches in order
and skips a call setup per batch, which matters when a policy emits a batch per tool start.  Batches are
sent one at a time (write, then read its ack) under a lock, so each call gets the ack of its own batch.
A broken stream is dropped and reopened by the next call; the failing call raises.

Errors are ``grpc.aio.AioRpcError``, whose ``.code()`` is the node's status (INVALID_ARGUMENT for a bad
prompt, NOT_FOUND for an unknown session on export, ...).  Contexts move between nodes as streams of
chunks: ``export_context`` and ``import_context`` are the two ends (``hints._move.move_context`` the
two-phase move built on them).  Imports only ``hints`` and grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc

from hints import engine_pb2, engine_pb2_grpc
from hints._convert import ack_from_proto, batch_to_proto, cache_state_from_proto
from hints._models import CacheState, Hint, HintAck, HintBatch

IMPORT_ACK_KEY = "hintflow-import"
"""Initial metadata a node sends on ``ImportContext`` once it has accepted the header and reserved the
blocks; the client streams the KV only after it."""

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "IMPORT_ACK_KEY",
    "EngineClient",
    "GenerateChunk",
    "GenerateResult",
]

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Same limit as the node: a context chunk holds up to 64 MiB, a context's header all its token ids."""

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""KV bytes per chunk of a context export (the node's own default too)."""


@dataclass
class GenerateResult:
    """One finished model call: its tokens and the node's cache accounting for the prompt."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_recomputed_tokens: int = 0
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message; ``result`` (accounting, no tokens yet) is set on the first chunk only."""

    token_ids: list[int]
    finished: bool
    finish_reason: str
    result: GenerateResult | None = None


class EngineClient:
    """Client of one node at ``address`` ("host:port"); use as ``async with EngineClient(addr) as c``."""

    def __init__(self, address: str, *, options: Sequence[tuple[str, Any]] = ()) -> None:
        self.address = address
        self._options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *options,
        ]
        self._channel: grpc.aio.Channel | None = None
        self._stub_: engine_pb2_grpc.EngineNodeStub | None = None
        self._hints_call: grpc.aio.StreamStreamCall | None = None
        self._hints_lock: asyncio.Lock | None = None
        self._batch_ids = itertools.count(1)

    @property
    def _stub(self) -> engine_pb2_grpc.EngineNodeStub:
        """The channel is made on first use, inside the event loop that will drive it."""
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub_ = engine_pb2_grpc.EngineNodeStub(self._channel)
        return self._stub_

    # ---- model calls ---------------------------------------------------------------------------
    async def stream_generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        session_id: str,
        program_id: str = "",
        priority: int | None = None,
        request_id: str = "",
        stop_token_ids: Sequence[int] = (),
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Tokens as the node produces them; leaving the loop early cancels the call (the node aborts it)."""
        req = engine_pb2.GenerateRequest(
            request_id=request_id,
            program_id=program_id,
            session_id=session_id,
            prompt_token_ids=list(prompt),
            max_new_tokens=max_new_tokens,
            priority=priority,
            stop_token_ids=list(stop_token_ids),
        )
        call = self._stub.Generate(req)
        try:
            first = True
            async for msg in call:
                result = None
                if first:
                    result = GenerateResult(
                        request_id=msg.request_id,
                        num_prompt_tokens=msg.num_prompt_tokens,
                        num_cached_tokens=msg.num_cached_tokens,
                        num_host_hit_tokens=msg.num_host_hit_tokens,
                        num_recomputed_tokens=msg.num_recomputed_tokens,
                        queue_wait_s=msg.queue_wait_s,
                        ttft_s=msg.ttft_s,
                    )
                    first = False
                yield GenerateChunk(list(msg.token_ids), msg.finished, msg.finish_reason, result)
        finally:
            call.cancel()  # no-op once finished

    async def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        session_id: str,
        program_id: str = "",
        priority: int | None = None,
        request_id: str = "",
        stop_token_ids: Sequence[int] = (),
    ) -> GenerateResult:
        """Run one turn to completion."""
        out = GenerateResult()
        async for chunk in self.stream_generate(
            prompt, max_new_tokens, session_id, program_id, priority, request_id, stop_token_ids
        ):
            if chunk.result is not None:
                out = chunk.result
            out.token_ids.extend(chunk.token_ids)
            out.finish_reason = chunk.finish_reason
        return out

    # ---- hints ---------------------------------------------------------------------------------
    async def push_hints(self, hints: Sequence[Hint], batch_id: int | None = None, node_epoch: int = 0) -> HintAck:
        """Send one batch over the persistent stream and wait for its ack; ``node_epoch``: the node life the
        hints are meant for (0: any; a node of another epoch applies none of them)."""
        batch = HintBatch(
            batch_id=next(self._batch_ids) if batch_id is None else batch_id,
            hints=list(hints),
            sent_unix_s=time.time(),
            node_epoch=node_epoch,
        )
        return await self.push_batch_proto(batch_to_proto(batch))

    async def push_batch_proto(self, batch: engine_pb2.HintBatch) -> HintAck:
        """Send a batch already in wire form (e.g. one a model would refuse, to test a node)."""
        if self._hints_lock is None:
            self._hints_lock = asyncio.Lock()
        async with self._hints_lock:
            if self._hints_call is None:
                self._hints_call = self._stub.PushHints()
            call = self._hints_call
            try:
                await call.write(batch)
                pb = await call.read()
            except BaseException:
                self._drop_hints_stream()
                raise
            if pb is grpc.aio.EOF:
                self._drop_hints_stream()
                code = await call.code()
                raise ConnectionError(f"PushHints stream to {self.address} ended ({code})")
            return ack_from_proto(pb)

    def _drop_hints_stream(self) -> None:
        if self._hints_call is not None:
            self._hints_call.cancel()
            self._hints_call = None

    # ---- cache state ---------------------------------------------------------------------------
    async def get_cache_state(self, include_sessions: bool = False) -> CacheState:
        pb = await self._stub.GetCacheState(
            engine_pb2.WatchCacheStateRequest(include_sessions=include_sessions)
        )
        return cache_state_from_proto(pb)

    async def watch_cache_state(
        self, interval_s: float = 1.0, include_sessions: bool = False
    ) -> AsyncGenerator[CacheState, None]:
        """The state now, then on every change (at most every 50 ms) and at least every ``interval_s``."""
        call = self._stub.WatchCacheState(
            engine_pb2.WatchCacheStateRequest(interval_s=interval_s, include_sessions=include_sessions)
        )
        try:
            async for pb in call:
                yield cache_state_from_proto(pb)
        finally:
            call.cancel()

    # ---- moving contexts (the two-phase move built on these: ``move_context``) --------------------
    async def export_context(
        self, session_id: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> AsyncGenerator[engine_pb2.ContextChunk, None]:
        """The session's context as chunks: first its header, then its KV, at most ``chunk_bytes`` (and at
        least one block) a chunk.  The node holds the session (no eviction, no turn) until the stream ends;
        leaving the loop early cancels the stream, and the node lets go at once."""
        call = self._stub.ExportContext(
            engine_pb2.ExportContextRequest(session_id=session_id, chunk_bytes=chunk_bytes)
        )
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()  # no-op once finished

    async def import_context(
        self, chunks: AsyncIterable[engine_pb2.ContextChunk]
    ) -> engine_pb2.ImportContextResponse:
        """Send a context's chunks (header first, as ``export_context`` yields them) to this node, one at a
        time; it commits the context once the last has arrived.  Failing or cancelled before that, the node
        keeps nothing of it."""
        call = self._stub.ImportContext()
        try:
            it = aiter(chunks)
            header = await anext(it, None)
            # The node acks an accepted header (its blocks reserved) before any KV is sent: a node that
            # refuses ends the call instead, and awaiting the call raises the node's code (a chunk written
            # into a refusal would turn that code into INTERNAL).
            if header is not None and await _write(call, header) and await _acked(call):
                async for chunk in it:
                    if call.done() or not await _write(call, chunk):
                        break  # the node ended the call: awaiting it raises why
            if not call.done():
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.done_writing()  # (the call may end meanwhile: its status says why)
            response: engine_pb2.ImportContextResponse = await call
            return response
        finally:
            call.cancel()  # no-op once finished

    async def drop_context(self, session_id: str, num_tokens: int) -> engine_pb2.DropContextResponse:
        """Free the session here if it is still parked with exactly the ``num_tokens`` tokens an export of it
        sent (no turn ran on it since); ``dropped`` says whether it was, ``reason`` why not."""
        return await self._stub.DropContext(
            engine_pb2.DropContextRequest(session_id=session_id, num_tokens=num_tokens)
        )

    # ---- lifetime ------------------------------------------------------------------------------
    async def close(self) -> None:
        self._drop_hints_stream()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub_ = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def _write(call: Any, msg: engine_pb2.ContextChunk) -> bool:
    """Write one chunk; False when the call ended under it (its status, awaited, says why)."""
    try:
        await call.write(msg)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False
    return True


async def _acked(call: Any) -> bool:
    """Whether the node acked the context's header (``IMPORT_ACK_KEY`` in its initial metadata)."""
    try:
        metadata = await call.initial_metadata()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False
    return any(key == IMPORT_ACK_KEY for key, _ in (metadata or ()))
