"""The receiving end of a context move: check the header, reserve every block up front, write chunks as
they arrive, and commit only once every block has arrived.

Until the commit the session is RUNNING with no request (and in ``kv.leased``): out of eviction, out of
any turn (``submit`` refuses it), with no tokens, so no prefix-index entry and no cache state points at a
half-written block.  The reserved blocks are the session's ``block_ids`` from the start, so the node's
accounting holds at every moment: a reserved block is counted once, as used.  ``abort`` (the server calls
it in a ``finally`` when the stream breaks or is cancelled) gives every reserved block back and removes a
session the import created.  Writes run under ``core.exclusive()``: a step's forward pass may still be
writing blocks an abort just freed, and only a step may use them then.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import TYPE_CHECKING

from pydantic import TypeAdapter, ValidationError

from hints import MAX_PIN_TTL_S, OptionalProgramId, SessionId

from ._context_blocks import ContextHeader, flush_copies
from ._engine_errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ._session import Session, SessionState

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["ContextImport", "begin_import", "check_header"]

_SESSION_ID: TypeAdapter[str] = TypeAdapter(SessionId)
_PROGRAM_ID: TypeAdapter[str] = TypeAdapter(OptionalProgramId)


def check_header(core: EngineCore, header: ContextHeader) -> None:
    """Everything about a header that can be refused before any state is touched."""
    ex = core.executor
    if header.model_fingerprint != ex.fingerprint():
        raise FailedPrecondition(
            f"context was computed by model {header.model_fingerprint!r}; this node runs {ex.fingerprint()!r}"
        )
    if header.block_size != core.block_size or header.dtype != ex.layout.dtype:
        raise FailedPrecondition(
            f"KV layout differs: block_size {header.block_size}/{header.dtype} vs "
            f"{core.block_size}/{ex.layout.dtype}"
        )
    for what, adapter, value in (
        ("session_id", _SESSION_ID, header.session_id),
        ("program_id", _PROGRAM_ID, header.program_id),
    ):
        try:  # the protocol's rules, as for Generate: an odd id would break every later CacheState
            adapter.validate_python(value)
        except ValidationError as e:
            raise InvalidArgument(f"{what}: {e.errors()[0]['msg']}") from None
    num_tokens = len(header.token_ids)
    num_blocks = math.ceil(num_tokens / core.block_size)
    if num_blocks > core.kv.device.num_blocks:  # refused before anything is evicted for it
        raise ResourceExhausted(
            f"{num_tokens} tokens need {num_blocks} blocks; node {core.node_id} has "
            f"{core.kv.device.num_blocks} in all"
        )
    if header.num_blocks != num_blocks or tuple(header.shape) != tuple(ex.kv_shape(num_blocks)):
        raise InvalidArgument(
            f"the header says {header.num_blocks} blocks of shape {tuple(header.shape)}; {num_tokens} tokens "
            f"need {num_blocks} blocks of shape {tuple(ex.kv_shape(num_blocks))}"
        )
    ids = header.token_ids
    if ids and (min(ids) < 0 or max(ids) >= ex.vocab_size):  # C-speed scans: contexts are long
        raise InvalidArgument("token_ids outside the vocabulary")
    if not 0.0 <= header.pin_ttl_s <= MAX_PIN_TTL_S:  # (false for NaN too)
        raise InvalidArgument(f"pin_ttl_s must be in [0, {MAX_PIN_TTL_S:g}], got {header.pin_ttl_s}")


class ContextImport:
    """An open import: ``write_chunk`` each run of blocks in order, then ``commit``; ``abort`` (or leaving
    a ``with`` block uncommitted) gives everything back.  ``write_chunk`` and ``abort`` may race (a
    cancelled stream's cleanup while a write is still in a worker thread): both decide under the lock."""

    def __init__(self, core: EngineCore, session: Session, header: ContextHeader, created: bool) -> None:
        self.core = core
        self.session = session
        self.header = header
        self._created = created  # the import made the session: an abort removes it
        self._blocks = list(session.block_ids)
        self.num_blocks_written = 0
        self._done = False  # committed or aborted

    def write_chunk(self, data: bytes, num_blocks: int) -> None:
        """KV of the next ``num_blocks`` blocks, in ``kv_shape(num_blocks)``'s layout."""
        nbytes = self.core.executor.layout.block_nbytes
        if num_blocks < 1 or len(data) != num_blocks * nbytes:
            raise InvalidArgument(
                f"a chunk of {num_blocks} blocks must hold {max(num_blocks, 0) * nbytes} bytes, got {len(data)}"
            )
        start = self.num_blocks_written
        if start + num_blocks > self.header.num_blocks:
            raise InvalidArgument(
                f"chunks carry more than the header's {self.header.num_blocks} blocks ({start} + {num_blocks})"
            )
        with self.core.exclusive():
            if self._done:
                raise FailedPrecondition(f"the import of session {self.header.session_id!r} has ended")
            self.core.executor.write_blocks("device", self._blocks[start : start + num_blocks], data)
            self.num_blocks_written = start + num_blocks

    def commit(self) -> tuple[int, int, int]:
        """Every block has arrived: the context becomes the session's, parked and pinned for the header's
        ``pin_ttl_s``.  Returns its tokens, blocks, and the blocks the pin holds."""
        core, kv, s = self.core, self.core.kv, self.session
        if self.num_blocks_written != self.header.num_blocks:
            raise InvalidArgument(
                f"the stream ended after {self.num_blocks_written} of {self.header.num_blocks} blocks"
            )
        with core.lock:
            if self._done:
                raise FailedPrecondition(f"the import of session {self.header.session_id!r} has ended")
            self._done = True
            kv.leased.discard(s)
            s.token_ids = list(self.header.token_ids)
            s.block_hashes = []
            s.epoch += 1
            kv._rehash(s)
            kv.park(s)  # (a Release that came meanwhile frees it here: its program is over)
            pinned = 0
            if self.header.pin_ttl_s > 0 and kv.sessions.get(s.session_id) is s:
                # so that it survives until the turn it was moved for arrives
                pinned = kv.set_pin(s, self.header.pin_ttl_s).pinned_blocks
            core._changed()
        return len(self.header.token_ids), self.header.num_blocks, pinned

    def abort(self) -> None:
        """Give back every reserved block and leave no half-made session (idempotent; no-op once committed)."""
        with self.core.lock:
            if self._done:
                return
            self._done = True
            _give_back(self.core, self.session, self._created)

    def __enter__(self) -> ContextImport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def _give_back(core: EngineCore, s: Session, created: bool) -> None:
    kv = core.kv
    kv.leased.discard(s)
    kv._drop_device(s, len(s.block_ids))
    kv.park(s)
    if created and kv.sessions.get(s.session_id) is s:
        kv.free_session(s)
    core._changed()


def begin_import(core: EngineCore, header: ContextHeader) -> ContextImport:
    """Check the header, then reserve every device block the context needs (evicting others if it must);
    ResourceExhausted at once, with nothing evicted, when there is no room."""
    check_header(core, header)
    kv = core.kv
    sid = header.session_id
    with core.exclusive():  # (a step's forward pass may not be writing blocks we take)
        existing = kv.sessions.get(sid)
        if existing is not None and header.program_id and existing.program_id != header.program_id:
            raise InvalidArgument(
                f"session {sid!r} belongs to program {existing.program_id!r}, not {header.program_id!r}"
            )
        if existing is not None and existing.state is not SessionState.PARKED:
            what = "being moved" if existing in kv.leased else existing.state.value
            raise FailedPrecondition(f"session {sid!r} is {what} here")
        s = kv.get_or_create(sid, header.program_id)
        core.exported_contexts.pop(s, None)  # a late DropContext of an earlier export must not free this one
        kv._drop_device(s, len(s.block_ids))  # the context arriving replaces what is here
        s.token_ids = []
        s.state = SessionState.RUNNING  # the lease: out of the eviction heaps and out of any turn
        kv.leased.add(s)
        kv._refresh(s)
        n = header.num_blocks
        blocks = kv.allocate_device(n, exclude=s) if n else []
        if blocks is None:
            _give_back(core, s, existing is None)
            raise ResourceExhausted(f"no room for {n} blocks on node {core.node_id}")
        try:
            flush_copies(core)  # offloads chosen just now must read their blocks before we overwrite them
        except Exception:
            for bid in blocks:  # not the session's yet: give them back, and leave no half-made session
                kv.device.unref(bid)
            _give_back(core, s, existing is None)
            raise
        s.block_ids = blocks
        s.epoch += 1
        kv._refresh(s)
        core._changed()
        return ContextImport(core, s, header, existing is None)
