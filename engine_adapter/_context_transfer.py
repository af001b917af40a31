"""Moving a parked session's KV context between nodes: ``ContextData`` out of one, into another.

Export flushes pending tier copies first and reads the context's blocks (device, then host) as bytes in
the executor's ``kv_shape`` layout;
import checks the model and layout, takes device blocks (evicting others if it must) and writes them.
Both run under the engine's lock and its ``executing`` lock: a step's forward pass, which runs outside
the engine's lock, may be writing into blocks just freed by an abort, and only a step may use them then.
Why apart from ``_engine``: the stepping loop and hints never
touch this path; ``EngineCore.export_context``/``import_context`` call in here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from pydantic import TypeAdapter, ValidationError

from hints import OptionalProgramId, SessionId

from ._engine_errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ._executor import ScheduledBatch
from ._session import SessionState

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["ContextData", "export_context", "import_context"]

_SESSION_ID: TypeAdapter[str] = TypeAdapter(SessionId)
_PROGRAM_ID: TypeAdapter[str] = TypeAdapter(OptionalProgramId)


@dataclass
class ContextData:
    """A session's KV context as bytes, to move between nodes (the wire form is ``ContextBlob``)."""

    session_id: str
    program_id: str
    token_ids: list[int]
    block_size: int
    model_fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    kv_data: bytes


def export_context(core: EngineCore, session_id: str, release_after: bool = False) -> ContextData:
    with core.exclusive():  # (its flush runs copies: never beside a step's forward pass)
        s = core._session(session_id)
        if s.state is not SessionState.PARKED:
            raise FailedPrecondition(f"session {session_id!r} is {s.state.value}; export it between turns")
        _flush_copies(core)
        ex = core.executor
        bs = core.block_size
        n_tokens = s.num_device_tokens + s.num_host_tokens
        dev_ids = s.block_ids[: -(-s.num_device_tokens // bs)]
        host_ids = s.host_block_ids[: -(-n_tokens // bs) - len(dev_ids)]
        parts = [(ex.read_blocks("device", dev_ids), len(dev_ids))] if dev_ids else []
        if host_ids:
            parts.append((ex.read_blocks("host", host_ids), len(host_ids)))
        data = _join_blocks(ex.kv_shape, parts)
        blob = ContextData(
            session_id=s.session_id,
            program_id=s.program_id,
            token_ids=s.token_ids[:n_tokens],
            block_size=core.block_size,
            model_fingerprint=ex.fingerprint(),
            dtype=ex.layout.dtype,
            shape=tuple(ex.kv_shape(len(dev_ids) + len(host_ids))),
            kv_data=data,
        )
        if release_after:
            core.kv.free_session(s)
            core._changed()
        return blob


def _join_blocks(kv_shape: Callable[[int], tuple[int, ...]], parts: list[tuple[bytes, int]]) -> bytes:
    """Bytes of ``n1 + n2 + ...`` blocks in ``kv_shape``'s layout from parts of ``n_i`` blocks each.

    The layout is layer-major (``[layers, K/V, blocks, ...]``): a part's bytes hold each layer's slice of
    all its blocks before the next layer's, so parts join along the block axis, not end to end (end to end,
    a context split over the device and host tiers came back with its blocks' layers interleaved).
    """
    if not parts:
        return b""
    if len(parts) == 1:
        return parts[0][0]
    one, two = kv_shape(1), kv_shape(2)
    axis = next(i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)  # the block axis
    lead = math.prod(one[:axis])
    arrays = [np.frombuffer(data, np.uint8).reshape(lead, n, -1) for data, n in parts]
    return np.concatenate(arrays, axis=1).tobytes()


def import_context(core: EngineCore, blob: ContextData) -> tuple[int, int]:
    ex = core.executor
    if blob.model_fingerprint != ex.fingerprint():
        raise FailedPrecondition(
            f"context was computed by model {blob.model_fingerprint!r}; this node runs {ex.fingerprint()!r}"
        )
    if blob.block_size != core.block_size or blob.dtype != ex.layout.dtype:
        raise FailedPrecondition(
            f"KV layout differs: block_size {blob.block_size}/{blob.dtype} vs {core.block_size}/{ex.layout.dtype}"
        )
    for what, adapter, value in (
        ("session_id", _SESSION_ID, blob.session_id),
        ("program_id", _PROGRAM_ID, blob.program_id),
    ):
        try:  # the protocol's rules, as for Generate: an odd id would break every later CacheState
            adapter.validate_python(value)
        except ValidationError as e:
            raise InvalidArgument(f"{what}: {e.errors()[0]['msg']}") from None
    n_blocks = math.ceil(len(blob.token_ids) / core.block_size)
    if n_blocks > core.kv.device.num_blocks:  # refused before anything is evicted for it
        raise ResourceExhausted(
            f"{len(blob.token_ids)} tokens need {n_blocks} blocks; node {core.node_id} has "
            f"{core.kv.device.num_blocks} in all"
        )
    expected = n_blocks * ex.layout.block_nbytes
    if len(blob.kv_data) != expected or tuple(blob.shape) != tuple(ex.kv_shape(n_blocks)):
        raise InvalidArgument(
            f"kv_data holds {len(blob.kv_data)} bytes with shape {tuple(blob.shape)}; {len(blob.token_ids)} "
            f"tokens need {expected} bytes with shape {tuple(ex.kv_shape(n_blocks))}"
        )
    ids = blob.token_ids
    if ids and (min(ids) < 0 or max(ids) >= ex.vocab_size):  # C-speed scans: contexts are long
        raise InvalidArgument("token_ids outside the vocabulary")
    with core.exclusive():  # (a step's forward pass may not be writing blocks we take)
        existing = core.kv.sessions.get(blob.session_id)
        if existing is not None and blob.program_id and existing.program_id != blob.program_id:
            raise InvalidArgument(
                f"session {blob.session_id!r} belongs to program {existing.program_id!r}, "
                f"not {blob.program_id!r}"
            )
        s = core.kv.get_or_create(blob.session_id, blob.program_id)
        if s.state is not SessionState.PARKED:
            raise FailedPrecondition(f"session {blob.session_id!r} is {s.state.value} here")
        core.kv._drop_device(s, len(s.block_ids))
        s.state = SessionState.RUNNING  # keeps it out of the eviction heaps while blocks are allocated
        blocks = core.kv.allocate_device(n_blocks, exclude=s) if n_blocks else []
        if blocks is None:
            core.kv.park(s)
            if existing is None:  # no empty session left behind by a failed import
                core.kv.free_session(s)
            core._changed()
            raise ResourceExhausted(f"no room for {n_blocks} blocks on node {core.node_id}")
        try:
            _flush_copies(core)  # offloads chosen just now must read their blocks before we overwrite
            if blocks:
                ex.write_blocks("device", blocks, blob.kv_data)
        except Exception:
            for bid in blocks:  # not the session's yet: give them back, and leave no half-made session
                core.kv.device.unref(bid)
            core.kv.park(s)
            if existing is None:
                core.kv.free_session(s)
            core._changed()
            raise
        s.token_ids = list(blob.token_ids)
        s.block_ids = blocks
        s.block_hashes = []
        core.kv._rehash(s)
        core.kv.park(s)
        core._changed()
        return len(blob.token_ids), n_blocks


def _flush_copies(core: EngineCore) -> None:
    """Run the pending tier copies now.  If the executor fails, they are handled as a failed step's: the
    contexts that would read a block they were to fill let go of it (recomputed later), then it raises."""
    ops = core.kv.take_copies()
    if not ops:
        return
    try:
        core.executor.execute(ScheduledBatch(copies=ops))
    except Exception:
        core.kv.discard_copies(ops)
        core._changed()
        raise
