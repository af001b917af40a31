"""The source end of a context move: a parked session's KV read out a chunk at a time under a lease, and
the second phase's drop of the source's copy.

The lease: while an export is open the session is RUNNING with no request (and in ``kv.leased``), so the
KV manager neither evicts its device blocks (only parked and queued contexts lose blocks) nor drops its
host blocks (``_refresh`` keeps a leased session off the host tier's eviction heap), a Release marks it
and frees it when the lease ends (as for a running turn), a prefetch leaves it alone, and ``submit``
refuses a turn on it.  So no block the export still has to read is freed or written meanwhile, and a move
that fails leaves the source's context exactly as it was.  The lease ends in ``close``: the server calls
it in a ``finally`` when the stream ends, is cancelled or its peer vanishes.

Each chunk is read under ``core.exclusive()`` (no step's forward pass beside it), one chunk at a time, so
the node never holds more than one chunk of the context in memory for the stream.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Literal

from ._context_blocks import ContextHeader, flush_copies, join_blocks
from ._engine_errors import FailedPrecondition
from ._session import Session, SessionState

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["ContextExport", "begin_export", "drop_exported"]

Tier = Literal["device", "host"]


class ContextExport:
    """An open export: ``read_chunk`` until it returns None, then ``close`` (or use it as a context manager).

    Thread-safe against ``close`` from another thread (a cancelled stream's cleanup may run while a read
    is still in a worker thread): both decide under the engine's lock.
    """

    def __init__(
        self,
        core: EngineCore,
        session: Session,
        header: ContextHeader,
        blocks: list[tuple[Tier, int]],
        blocks_per_chunk: int,
    ) -> None:
        self.core = core
        self.session = session
        self.header = header
        self._blocks = blocks  # (tier, block id) of every block to send, in context order
        self._blocks_per_chunk = blocks_per_chunk
        self.num_blocks_read = 0
        self._closed = False

    @property
    def complete(self) -> bool:
        """Every block has been read out."""
        return self.num_blocks_read == len(self._blocks)

    def read_chunk(self) -> tuple[bytes, int] | None:
        """KV of the next run of whole blocks and how many blocks it holds; None once all were read."""
        if self.complete:
            return None
        start = self.num_blocks_read
        run = self._blocks[start : start + self._blocks_per_chunk]
        ex = self.core.executor
        with self.core.exclusive():
            if self._closed:
                raise FailedPrecondition(f"the export of session {self.session.session_id!r} was closed")
            device = [b for tier, b in run if tier == "device"]  # (device blocks come first in a context)
            host = [b for tier, b in run if tier == "host"]
            parts = [(ex.read_blocks("device", device), len(device))] if device else []
            if host:
                parts.append((ex.read_blocks("host", host), len(host)))
        self.num_blocks_read += len(run)
        return join_blocks(ex.kv_shape, parts), len(run)

    def close(self, *, drop: bool = False) -> None:
        """End the lease (idempotent).  ``drop``: free the session here too (an in-process move, whose copy
        has already arrived).  An export read to its end leaves a stamp that lets ``drop_exported`` free
        the session later, if no turn has run on it by then."""
        core = self.core
        kv = core.kv
        with core.lock:
            if self._closed:
                return
            self._closed = True
            s = self.session
            kv.leased.discard(s)
            if kv.sessions.get(s.session_id) is s and s.state is SessionState.RUNNING:
                # Parked again, as it was: its blocks, its LRU time.  What came meanwhile applies now: a
                # Release frees it (as at a turn's end), a pin sent meanwhile is granted (an expired one
                # was already ended by ``tick``).
                s.state = SessionState.PARKED
                if drop or s.released:
                    kv.free_session(s)
                else:
                    if s.pin_deadline_s is not None and s.pin_deadline_s > kv.clock.now():
                        kv._grant_pin(s)
                    kv._refresh(s)
                    if self.complete:
                        core.exported_contexts[s] = (s.num_turns, len(self.header.token_ids))
            core._changed()

    def __enter__(self) -> ContextExport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def begin_export(core: EngineCore, session_id: str, chunk_bytes: int | None = None) -> ContextExport:
    """Lease a parked session for export; chunks of at most ``chunk_bytes`` KV bytes (at least one block
    each; None: the whole context in one chunk, for in-process moves)."""
    kv = core.kv
    with core.exclusive():  # (its flush runs copies: never beside a step's forward pass)
        s = core._session(session_id)
        if s.state is not SessionState.PARKED:
            what = "being moved" if s in kv.leased else s.state.value
            raise FailedPrecondition(f"session {session_id!r} is {what}; export it between turns")
        flush_copies(core)  # (its failure may cut the context: the block lists are read after it)
        ex = core.executor
        bs = core.block_size
        num_tokens = s.num_device_tokens + s.num_host_tokens
        device_ids = s.block_ids[: -(-s.num_device_tokens // bs)]
        host_ids = s.host_block_ids[: -(-num_tokens // bs) - len(device_ids)]
        blocks: list[tuple[Tier, int]] = [("device", b) for b in device_ids] + [("host", b) for b in host_ids]
        num_blocks = len(blocks)
        header = ContextHeader(
            session_id=s.session_id,
            program_id=s.program_id,
            token_ids=s.token_ids[:num_tokens],
            block_size=bs,
            model_fingerprint=ex.fingerprint(),
            dtype=ex.layout.dtype,
            shape=tuple(ex.kv_shape(num_blocks)),
            num_blocks=num_blocks,
        )
        per_chunk = max(1, num_blocks if chunk_bytes is None else chunk_bytes // ex.layout.block_nbytes)
        s.state = SessionState.RUNNING  # the lease (see the module docstring)
        kv.leased.add(s)
        kv._refresh(s)
        core._changed()
        return ContextExport(core, s, header, blocks, per_chunk)


def drop_exported(core: EngineCore, session_id: str, num_tokens: int) -> tuple[bool, str]:
    """Free the session if it is still parked with exactly what an export of ``num_tokens`` tokens sent
    (no turn has run on it since, and none is queued); else keep it.  Whether it was dropped, and why not."""
    kv = core.kv
    with core.lock:
        s = kv.sessions.get(session_id)
        if s is None:
            return False, f"unknown session {session_id!r} on node {core.node_id}"
        if s.state is not SessionState.PARKED:
            return False, f"session {session_id!r} is {'being moved' if s in kv.leased else s.state.value}"
        stamp = core.exported_contexts.get(s)
        if stamp is None:
            return False, f"no export of session {session_id!r} finished on node {core.node_id}"
        num_turns, exported_tokens = stamp
        if num_turns != s.num_turns:
            return False, f"a turn ran on session {session_id!r} since it was exported"
        if exported_tokens != num_tokens:
            return (
                False,
                f"the export of session {session_id!r} sent {exported_tokens} tokens, not {num_tokens}",
            )
        del core.exported_contexts[s]
        kv.free_session(s)
        core._changed()
        return True, ""
