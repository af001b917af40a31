"""Moving a parked session's KV context from one embedded node to another: two phases over the nodes'
``ExportContext`` / ``ImportContext`` / ``DropContext`` streams (see ``move_context`` for what each failure
leaves where, and docs/failures.md).  Imports only ``hints`` and grpc.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from hints import engine_pb2
from hints._client import DEFAULT_CHUNK_BYTES, EngineClient

__all__ = ["ContextMove", "ContextMoveError", "move_context"]


@dataclass(frozen=True)
class ContextMove:
    """A finished move: the context is committed at the destination (and pinned there for ``pin_ttl_s``)."""

    session_id: str
    num_tokens: int
    num_blocks: int
    num_bytes: int  # KV bytes streamed
    num_chunks: int  # KV chunks streamed (the header's not counted)
    elapsed_s: float
    source_dropped: bool  # the source freed its copy
    source_kept_reason: str = ""  # why it kept it (a turn ran there since the export, drop_source=False)
    pinned_blocks: int = 0  # blocks the destination's pin holds


class ContextMoveError(Exception):
    """A move failed in ``phase`` ("export", "import" or "drop"); ``code`` is the node's status, if any.
    After a failed "drop" the import is committed: ``move`` says so, and both nodes hold the context."""

    def __init__(
        self,
        phase: str,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        move: ContextMove | None = None,
    ) -> None:
        super().__init__(f"context move failed in {phase}: {message}")
        self.phase = phase
        self.message = message
        self.code = code
        self.move = move


def _rpc_message(e: grpc.aio.AioRpcError, address: str) -> str:
    return f"{address}: {e.code().name}: {e.details()}"


async def move_context(
    src: EngineClient,
    dst: EngineClient,
    session_id: str,
    *,
    pin_ttl_s: float = 30.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    drop_source: bool = True,
    on_chunk: Callable[[int, int], Awaitable[None]] | None = None,
) -> ContextMove:
    """Move a parked session's context from ``src`` to ``dst`` in two phases.

    1. The source's export stream is piped into the destination's import stream, one chunk at a time (a
       chunk is written before the next is read, so at most a chunk or two are in flight). The
       destination reserves every block first and commits once the last chunk is in, pinned ``pin_ttl_s``
       so that it survives until the turn it was moved for arrives.
    2. Only after the destination acknowledged the commit, ``DropContext`` lets the source free its copy,
       if no turn has run on it since the export (``drop_source=False``: keep it, a copy).

    Whatever fails, the context is never lost: before the commit the source keeps it (its lease ends with
    the stream) and the destination keeps nothing; after the commit both may hold it, the destination's
    copy pinned only for ``pin_ttl_s``. ``on_chunk(index, num_bytes)`` runs after each KV chunk has been
    handed to the destination (progress, or a test's fault injection). Raises ``ContextMoveError``.
    """
    t0 = time.monotonic()
    header: engine_pb2.ContextHeader | None = None
    num_bytes = num_chunks = 0

    async def forward() -> AsyncGenerator[engine_pb2.ContextChunk, None]:
        nonlocal header, num_bytes, num_chunks
        chunks = src.export_context(session_id, chunk_bytes)
        try:
            while True:
                try:
                    msg = await anext(chunks)
                except StopAsyncIteration:
                    return
                except grpc.aio.AioRpcError as e:
                    raise ContextMoveError("export", _rpc_message(e, src.address), code=e.code()) from e
                if msg.HasField("header"):
                    msg.header.pin_ttl_s = pin_ttl_s  # the receiver's pin is the mover's to choose
                    header = msg.header
                    yield msg
                    continue
                num_bytes += len(msg.kv_data)
                num_chunks += 1
                yield msg
                if on_chunk is not None:
                    await on_chunk(num_chunks - 1, len(msg.kv_data))
        finally:
            await chunks.aclose()  # ends the export stream now: the source's lease goes with it

    piped = forward()
    try:
        response = await dst.import_context(piped)
    except grpc.aio.AioRpcError as e:
        raise ContextMoveError("import", _rpc_message(e, dst.address), code=e.code()) from e
    finally:
        await piped.aclose()  # (on a failed import too: not left to the garbage collector)
    if header is None:  # (a destination commits nothing without one)
        raise ContextMoveError("export", f"{src.address} sent no header")
    move = ContextMove(
        session_id=session_id,
        num_tokens=response.num_tokens,
        num_blocks=response.num_blocks,
        num_bytes=num_bytes,
        num_chunks=num_chunks,
        elapsed_s=time.monotonic() - t0,
        source_dropped=False,
        source_kept_reason="" if drop_source else "drop_source=False",
        pinned_blocks=response.pinned_blocks,
    )
    if not drop_source:
        return move
    try:
        dropped = await src.drop_context(session_id, len(header.token_ids))
    except grpc.aio.AioRpcError as e:
        raise ContextMoveError("drop", _rpc_message(e, src.address), code=e.code(), move=move) from e
    return dataclasses.replace(
        move,
        elapsed_s=time.monotonic() - t0,
        source_dropped=dropped.dropped,
        source_kept_reason=dropped.reason,
    )
