"""A parked session's KV context out of and into a vLLM node: the vLLM side of ``ExportContext`` /
``ImportContext`` / ``DropContext`` (the hint service serves them; ``hints.move_context`` drives a move).

Why this is possible without changing vLLM: with one GPU (or on the CPU build with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; by default it runs the model in a worker process for OpenMP) vLLM
runs the model in the engine-core process (``UniProcExecutor``), where this scheduler and its hint service
live, and
every attention layer holds its KV tensor (``compilation_config.static_forward_context``), indexed by the
block pool's block ids. So a context moves as the blocks of its prefix: read out by block id, written
into blocks the receiver takes from its own pool, and entered in its prefix cache under the hashes its
own requests will compute for those tokens, so the session's next turn there is a prefix hit. Where the
model runs in other processes (tensor or pipeline parallel) there are no tensors here: the node refuses
with FAILED_PRECONDITION and the mover falls back to recomputing the context at the destination.

The two ends and their leases, as the embedded node's (``engine_adapter._context_export`` / ``_import``):

- *export*: the resident full blocks of the session's last turn (``VSession.snapshot``, up to the first
  block evicted since) get a reference each (``BlockPool.touch``) for the stream's life, so the pool
  cannot hand them out while they are read; ``close`` gives the references back. A turn that arrives
  meanwhile runs (it only reads those blocks). Chunks hold whole blocks, block-major: ``[blocks, layers,
  *one layer's block]``, so they join end to end.
- *import*: every block is reserved first (``BlockPool.get_new_blocks``; RESOURCE_EXHAUSTED at once when
  the pool has too few free), written chunk by chunk (no request can see them: they carry no hash yet),
  and entered in the prefix cache only at ``commit``, once all have arrived; then pinned for the header's
  ``pin_ttl_s``. ``abort`` hands the blocks back unhashed, so a cut import leaves nothing a lookup finds.
- *drop*: the source frees its copy only if no turn ran on the session since the export (its snapshot is
  the one exported), as ``release_program`` frees a context: unpinned, first in line for reuse.

With hintflow's host tier in ``evict`` mode, taking a cached block for an import makes the tier copy the
evicted content at the next step; the import writes before that, so those saves are dropped
(``HintflowHostTier.forget_evictions``): the evicted contexts are then lost, as without a host tier. Only
device blocks move: what the host tier holds of a context is not exported (its turn reloads it there).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from engine_adapter._context_blocks import ContextHeader
from engine_adapter._engine_errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hints import MAX_PIN_TTL_S

if TYPE_CHECKING:
    from ._hint_scheduler import HintSchedulerMixin
    from ._sessions import VSession

__all__ = ["KvLayout", "VllmExport", "VllmImport", "begin_export", "begin_import", "block_dim", "drop_exported"]


def block_dim(shape: Sequence[int], num_blocks: int, what: str) -> int:
    """The one dimension of a layer's KV tensor that indexes blocks (the one of size ``num_blocks``)."""
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if len(dims) != 1:
        raise RuntimeError(f"{what}: cannot tell the block dimension of a KV cache of shape {tuple(shape)}, "
                           f"{num_blocks} blocks")  # fmt: skip
    return dims[0]


@dataclass(frozen=True)
class KvLayout:
    """The node's KV tensors by layer, viewed block-major, and what a receiver must match."""

    layers: tuple[torch.Tensor, ...]  # each layer's KV with the block dimension moved first (views)
    block_shape: tuple[int, ...]  # one layer's one block
    dtype: str
    fingerprint: str

    @property
    def block_nbytes(self) -> int:
        return len(self.layers) * math.prod(self.block_shape) * self.layers[0].element_size()

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, len(self.layers), *self.block_shape)

    def read(self, block_ids: Sequence[int]) -> bytes:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        out = torch.stack([kv.index_select(0, idx) for kv in self.layers], dim=1).contiguous().cpu()
        return out.view(torch.uint8).numpy().tobytes()

    def write(self, block_ids: Sequence[int], data: bytes) -> None:
        n = len(block_ids)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        t = flat.view(self.layers[0].dtype).view(self.shape(n)).to(self.layers[0].device)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        for i, kv in enumerate(self.layers):
            kv.index_copy_(0, idx, t[:, i])


def kv_layout(vllm_config: Any, num_blocks: int) -> KvLayout:
    """The layout of this process's KV tensors; FailedPrecondition where the model runs elsewhere."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    tensors = [(name, layer.kv_cache) for name, layer in ctx.items() if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)]
    tensors = [(name, kv) for name, kv in tensors if kv.numel() > 0]
    if not tensors:
        raise FailedPrecondition(
            "this vLLM node's model runs in other processes (tensor or pipeline parallel): its KV cannot be "
            "read or written here, so contexts are recomputed where they go"
        )
    layers = []
    for name, kv in sorted(tensors, key=lambda x: _layer_index(x[0])):
        layers.append(kv.movedim(block_dim(kv.shape, num_blocks, f"layer {name}"), 0))
    shapes = {tuple(kv.shape[1:]) for kv in layers}
    dtypes = {kv.dtype for kv in layers}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise FailedPrecondition(f"the layers' KV differ in shape or dtype ({shapes}, {dtypes}): no moves here")
    block_shape = shapes.pop()
    dtype = str(dtypes.pop()).removeprefix("torch.")
    mc = vllm_config.model_config
    fingerprint = f"vllm:{mc.model}@{mc.revision or 'main'}:{dtype}:{len(layers)}x{'x'.join(map(str, block_shape))}"
    return KvLayout(tuple(layers), block_shape, dtype, fingerprint)


def _layer_index(name: str) -> tuple[int, str]:
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    return (nums[0] if nums else -1, name)


def _resident(s: VSession) -> list[Any]:
    """The leading blocks of the session's last turn still cached under the hash they had then."""
    out = []
    for block, h in s.snapshot:
        if block.block_hash != h:
            break
        out.append(block)
    return out


class VllmExport:
    """An open export: ``read_chunk`` until None, then ``close`` (idempotent; gives the lease back)."""

    def __init__(self, sched: HintSchedulerMixin, s: VSession, header: ContextHeader, blocks: list[Any],
                 layout: KvLayout, blocks_per_chunk: int) -> None:  # fmt: skip
        self.sched, self.session, self.header, self.layout = sched, s, header, layout
        self._blocks = blocks
        self._per_chunk = blocks_per_chunk
        self.num_blocks_read = 0
        self._closed = False

    def read_chunk(self) -> tuple[bytes, int] | None:
        if self.num_blocks_read == len(self._blocks):
            return None
        if self._closed:
            raise FailedPrecondition(f"the export of session {self.header.session_id!r} was closed")
        run = self._blocks[self.num_blocks_read : self.num_blocks_read + self._per_chunk]
        data = self.layout.read([b.block_id for b in run])  # held by the lease: nobody writes them
        self.num_blocks_read += len(run)
        return data, len(run)

    def close(self) -> None:
        with self.sched.hint_lock:
            if self._closed:
                return
            self._closed = True
            self.sched.book.pool.free_blocks(reversed(self._blocks))  # the lease's references
            if self.num_blocks_read == len(self._blocks):
                self.sched.exported[self.header.session_id] = (_stamp(self.session), len(self.header.token_ids))


def _stamp(s: VSession) -> tuple[tuple[int, Any], ...]:
    """What identifies the context a session holds: its last turn's blocks and their hashes."""
    return tuple((b.block_id, h) for b, h in s.snapshot)


def begin_export(sched: HintSchedulerMixin, session_id: str, chunk_bytes: int) -> VllmExport:
    layout = sched.context_layout()
    bs = sched.block_size
    with sched.hint_lock:
        s = sched.book.sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown session {session_id!r} on node {sched.node_id}")
        if s.live:
            raise FailedPrecondition(f"session {session_id!r} is {s.state}; export it between turns")
        blocks = _resident(s)[: len(s.context) // bs]
        if not blocks:
            raise FailedPrecondition(f"no block of session {session_id!r}'s context is left on node {sched.node_id}")
        sched.book.pool.touch(blocks)  # the lease: out of the free queue until close()
        n = len(blocks)
        header = ContextHeader(
            session_id=s.session_id, program_id=s.program_id, token_ids=s.context[: n * bs].tolist(),
            block_size=bs, model_fingerprint=layout.fingerprint, dtype=layout.dtype, shape=layout.shape(n),
            num_blocks=n,
        )  # fmt: skip
        per_chunk = max(1, chunk_bytes // layout.block_nbytes)
        return VllmExport(sched, s, header, blocks, layout, per_chunk)


def drop_exported(sched: HintSchedulerMixin, session_id: str, num_tokens: int) -> tuple[bool, str]:
    """Free the session's context if it is the one an export of ``num_tokens`` tokens sent; else keep it."""
    with sched.hint_lock:
        s = sched.book.sessions.get(session_id)
        if s is None:
            return False, f"unknown session {session_id!r} on node {sched.node_id}"
        stamp = sched.exported.get(session_id)
        if stamp is None:
            return False, f"no export of session {session_id!r} finished on node {sched.node_id}"
        if s.live or stamp[0] != _stamp(s):
            return False, f"a turn ran on session {session_id!r} since it was exported"
        if stamp[1] != num_tokens:
            return False, f"the export of session {session_id!r} sent {stamp[1]} tokens, not {num_tokens}"
        del sched.exported[session_id]
        sched.book.drop_context(s)
        return True, ""


def check_header(sched: HintSchedulerMixin, layout: KvLayout, header: ContextHeader) -> None:
    """Everything about a header that can be refused before a block is taken."""
    bs = sched.block_size
    if header.model_fingerprint != layout.fingerprint:
        raise FailedPrecondition(f"context was computed by {header.model_fingerprint!r}; this node runs {layout.fingerprint!r}")
    if header.block_size != bs or header.dtype != layout.dtype:
        raise FailedPrecondition(f"KV layout differs: block_size {header.block_size}/{header.dtype} vs {bs}/{layout.dtype}")
    num_tokens = len(header.token_ids)
    if num_tokens % bs:
        raise InvalidArgument(f"a vLLM node takes whole blocks: {num_tokens} tokens are not a multiple of {bs}")
    n = num_tokens // bs
    if header.num_blocks != n or tuple(header.shape) != layout.shape(n):
        raise InvalidArgument(f"the header says {header.num_blocks} blocks of shape {tuple(header.shape)}; "
                              f"{num_tokens} tokens need {n} blocks of shape {layout.shape(n)}")  # fmt: skip
    if n > sched.book.num_blocks:
        raise ResourceExhausted(f"{num_tokens} tokens need {n} blocks; node {sched.node_id} has {sched.book.num_blocks}")
    ids = header.token_ids
    if ids and (min(ids) < 0 or max(ids) >= sched.vocab_size):
        raise InvalidArgument("token_ids outside the vocabulary")
    if not 0.0 <= header.pin_ttl_s <= MAX_PIN_TTL_S:
        raise InvalidArgument(f"pin_ttl_s must be in [0, {MAX_PIN_TTL_S:g}], got {header.pin_ttl_s}")


class VllmImport:
    """An open import: ``write_chunk`` each run of blocks in order, then ``commit``; ``abort`` gives back."""

    def __init__(self, sched: HintSchedulerMixin, header: ContextHeader, blocks: list[Any], layout: KvLayout) -> None:
        self.sched, self.header, self.layout = sched, header, layout
        self._blocks = blocks
        self.num_blocks_written = 0
        self._done = False

    def write_chunk(self, data: bytes, num_blocks: int) -> None:
        if num_blocks < 1 or len(data) != num_blocks * self.layout.block_nbytes:
            raise InvalidArgument(f"a chunk of {num_blocks} blocks must hold "
                                  f"{max(num_blocks, 0) * self.layout.block_nbytes} bytes, got {len(data)}")  # fmt: skip
        start = self.num_blocks_written
        if start + num_blocks > len(self._blocks):
            raise InvalidArgument(f"chunks carry more than the header's {len(self._blocks)} blocks ({start} + {num_blocks})")
        if self._done:
            raise FailedPrecondition(f"the import of session {self.header.session_id!r} has ended")
        # (reserved for this import and unhashed: no request reads or writes them meanwhile)
        self.layout.write([b.block_id for b in self._blocks[start : start + num_blocks]], data)
        self.num_blocks_written = start + num_blocks

    def commit(self) -> tuple[int, int, int]:
        """Every block is in: enter them in the prefix cache, make them the session's last context, pin."""
        h = self.header
        if self.num_blocks_written != len(self._blocks):
            raise InvalidArgument(f"the stream ended after {self.num_blocks_written} of {len(self._blocks)} blocks")
        sched, book = self.sched, self.sched.book
        with sched.hint_lock:
            if self._done:
                raise FailedPrecondition(f"the import of session {h.session_id!r} has ended")
            self._done = True
            s = book.session(h.session_id, h.program_id)
            if s.live:  # a turn arrived while the context streamed in: it has begun without it
                book.pool.free_blocks(reversed(self._blocks))
                raise FailedPrecondition(f"session {h.session_id!r} started a turn here while its context arrived")
            stand_in = SimpleNamespace(
                request_id=f"hintflow-import-{h.session_id}", block_hashes=sched.hash_blocks(h.token_ids),
                all_token_ids=h.token_ids, mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None,
                session_id=h.session_id,  # (what vLLM's KV events, when on, report the stored blocks under)
            )  # fmt: skip
            bs = sched.block_size
            book.pool.cache_full_blocks(stand_in, self._blocks, 0, len(self._blocks), bs, 0)
            book.adopt_context(s, self._blocks, array("q", h.token_ids))
            pinned = book.set_pin(s, h.pin_ttl_s).pinned_blocks if h.pin_ttl_s > 0 else 0
            book.pool.free_blocks(reversed(self._blocks))  # the reservation's references: the pin holds its own
            sched.exported.pop(h.session_id, None)  # an earlier export's late drop must not free this one
        return len(h.token_ids), len(self._blocks), pinned

    def abort(self) -> None:
        with self.sched.hint_lock:
            if self._done:
                return
            self._done = True
            self.sched.book.pool.free_blocks(reversed(self._blocks))  # unhashed: free, found by no lookup


def begin_import(sched: HintSchedulerMixin, header: ContextHeader) -> VllmImport:
    layout = sched.context_layout()
    check_header(sched, layout, header)
    with sched.hint_lock:
        s = sched.book.sessions.get(header.session_id)
        if s is not None and s.live:
            raise FailedPrecondition(f"session {header.session_id!r} is {s.state} here")
        if s is not None and header.program_id and s.program_id != header.program_id:
            raise InvalidArgument(f"session {header.session_id!r} belongs to program {s.program_id!r}, "
                                  f"not {header.program_id!r}")  # fmt: skip
        n = header.num_blocks
        pool = sched.book.pool
        if n > pool.get_num_free_blocks():
            raise ResourceExhausted(f"no room for {n} blocks on node {sched.node_id} ({pool.get_num_free_blocks()} free)")
        blocks = pool.get_new_blocks(n)
        if sched.host_tier is not None:  # their evicted content must not be copied after we overwrite it
            sched.host_tier.forget_evictions({b.block_id for b in blocks})
        return VllmImport(sched, header, blocks, layout)
