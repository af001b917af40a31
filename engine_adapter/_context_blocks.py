"""What both ends of a context move share: the header that describes a context, KV bytes of runs of blocks
joined along the block axis, and running the pending tier copies before KV is read or written.

Why apart from ``_context_export``/``_context_import``: the two ends must agree on the layout of a chunk,
so one module owns it.  A chunk's bytes are ``kv_shape(k)``'s layout for its ``k`` blocks, the same layout
``Executor.read_blocks`` returns, so a receiver writes each chunk as it arrives with no reshuffle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hints import engine_pb2

from ._executor import ScheduledBatch

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "ContextHeader", "flush_copies", "header_from_proto",
    "header_to_proto", "join_blocks",
]  # fmt: skip

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""KV bytes per chunk when the reader names none: small next to a context, large next to a message's cost."""

MAX_CHUNK_BYTES = 64 * 1024 * 1024
"""A larger request is cut down to this: one chunk must stay far below gRPC's message limit."""


@dataclass(frozen=True)
class ContextHeader:
    """A context about to move: everything the receiver checks before it takes a block (wire: ``ContextHeader``)."""

    session_id: str
    program_id: str
    token_ids: list[int]
    block_size: int
    model_fingerprint: str
    dtype: str
    shape: tuple[int, ...]  # the whole context's KV as one tensor, ``kv_shape(num_blocks)``
    num_blocks: int
    pin_ttl_s: float = 0.0  # the receiver pins the committed context this long (0: no pin)


def header_to_proto(h: ContextHeader) -> engine_pb2.ContextHeader:
    """The wire form; both nodes' servers send it (same field names: a field added to one side and not the
    other fails loudly here)."""
    return engine_pb2.ContextHeader(**{**vars(h), "shape": list(h.shape)})


def header_from_proto(pb: engine_pb2.ContextHeader) -> ContextHeader:
    fields = {f.name: getattr(pb, f.name) for f in dataclasses.fields(ContextHeader)}
    return ContextHeader(**{**fields, "token_ids": list(pb.token_ids), "shape": tuple(pb.shape)})


def join_blocks(kv_shape: Callable[[int], tuple[int, ...]], parts: list[tuple[bytes, int]]) -> bytes:
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


def flush_copies(core: EngineCore) -> None:
    """Run the pending tier copies now (the caller holds ``core.exclusive()``).  If the executor fails,
    they are handled as a failed step's: the contexts that would read a block they were to fill let go of
    it (recomputed later), then it raises."""
    ops = core.kv.take_copies()
    if not ops:
        return
    try:
        core.executor.execute(ScheduledBatch(copies=ops))
    except Exception:
        core.kv.discard_copies(ops)
        core._changed()
        raise
