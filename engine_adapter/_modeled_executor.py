"""An executor that prices steps instead of computing them, for simulation at production scale.

The scheduler, KV manager and hint policy run unchanged on top of it; only the forward pass is replaced
by ``CostModel.step_time``.  It still validates every batch the way the torch executor does, so a
scheduler bug fails here too instead of hiding behind a model that accepts anything.  The engine owns the
(virtual) clock and advances it by ``StepOutput.elapsed_s``: the executor never touches time itself.

KV bytes: nothing is computed, but bytes written into blocks (imports from a peer) and moved by copies
(offload/reload) are kept per block, so export/import between modeled nodes and host-tier round trips
behave like the torch executor's.  Blocks never written read as zeros.  KV that a modeled forward would
have produced is not materialised: a block holds what was last written or copied into it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal

import numpy as np

from engine_adapter._cost_model import CostModel
from engine_adapter._executor import BatchChecker, KVLayout, ScheduledBatch, ScheduledSeq, StepOutput

__all__ = ["ModeledExecutor"]

Tier = Literal["device", "host"]
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class ModeledExecutor(BatchChecker):
    """Executor protocol implementation whose steps cost ``cost_model.step_time(batch)`` seconds."""

    name = "modeled"

    def __init__(
        self,
        cost_model: CostModel,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        vocab_size: int = 512,
        max_model_len: int = 131072,
        layout: KVLayout | None = None,
        seed: int = 0,
    ) -> None:
        if num_device_blocks < 0 or num_host_blocks < 0:
            raise ValueError("block counts must be >= 0")
        if vocab_size < 1 or max_model_len < 1:
            raise ValueError("vocab_size and max_model_len must be positive")
        # Tiny default layout: bytes are stored only for blocks actually written, so size barely matters.
        layout = layout or KVLayout(2, 2, 8, cost_model.block_size, "float16")
        if layout.dtype not in _ITEMSIZE:
            raise ValueError(f"layout dtype must be one of {sorted(_ITEMSIZE)}, got {layout.dtype!r}")
        if layout.block_size != cost_model.block_size:
            raise ValueError(
                f"layout.block_size={layout.block_size} differs from the cost model's "
                f"block_size={cost_model.block_size}: copies would be mispriced"
            )
        self.cost_model, self.layout, self.seed = cost_model, layout, seed
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._blocks: dict[tuple[Tier, int], bytes] = {}  # (tier, block id) -> one block's bytes

    @property
    def host_reload_s_per_token(self) -> float:
        """The cost model's copy per token (what a reload costs on the clock it keeps); 0 with no host tier."""
        cm = self.cost_model
        return cm.copy_per_block_s / cm.block_size if self.num_host_blocks else 0.0

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        lay = self.layout
        return (lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)

    def fingerprint(self) -> str:
        blob = json.dumps(
            {"executor": self.name, "cost_model": self.cost_model.name, **dataclasses.asdict(self.layout)},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # -- steps ---------------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        for op in batch.copies:
            self._check_copy(op)
        self._check_seqs(batch.seqs)
        for op in batch.copies:  # in list order: an offload may free a block a later reload fills
            src: tuple[Tier, int] = ("device", op.src) if op.kind == "d2h" else ("host", op.src)
            dst: tuple[Tier, int] = ("host", op.dst) if op.kind == "d2h" else ("device", op.dst)
            if src in self._blocks:
                self._blocks[dst] = self._blocks[src]
            else:
                self._blocks.pop(dst, None)
        sampled = {s.request_id: self._sample(s) for s in batch.seqs if s.sample}
        return StepOutput(sampled=sampled, elapsed_s=self.cost_model.step_time(batch))

    def _sample(self, seq: ScheduledSeq) -> int:
        return self.sample_at(seq.request_id, seq.start_pos + len(seq.token_ids))

    def sample_at(self, request_id: str, pos: int) -> int:
        """The token sampled after ``pos`` positions of a request: pseudo-random, and a function of (seed,
        request, position) only, so replays are identical however their steps are grouped."""
        digest = hashlib.blake2b(f"{self.seed}\0{request_id}\0{pos}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.vocab_size

    # -- validation (shared checks: BatchChecker) ----------------------------------------------------

    def _check_ids(self, tier: Tier, block_ids: list[int]) -> None:
        limit = {"device": self.num_device_blocks, "host": self.num_host_blocks}.get(tier)
        if limit is None:
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= limit):  # C-speed scan: tables are long
            bad = next(b for b in block_ids if not 0 <= b < limit)
            raise ValueError(f"{tier} block id {bad} out of range [0, {limit})")

    # -- raw KV transfer -----------------------------------------------------------------------------

    def _split_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """``kv_shape`` as bytes, grouped so that ``[:, i, :]`` is block ``i`` (layers x K/V lead)."""
        lay = self.layout
        per_kv_block = lay.block_size * lay.num_kv_heads * lay.head_dim * _ITEMSIZE[lay.dtype]
        return (lay.num_layers * 2, num_blocks, per_kv_block)

    def read_blocks(self, tier: Tier, block_ids: list[int]) -> bytes:
        """Stored bytes of each block (zeros where never written), in the torch executor's layout."""
        self._check_ids(tier, block_ids)
        out = np.zeros(self._split_shape(len(block_ids)), dtype=np.uint8)
        for i, b in enumerate(block_ids):
            stored = self._blocks.get((tier, b))
            if stored is not None:
                out[:, i, :] = np.frombuffer(stored, dtype=np.uint8).reshape(out.shape[0], out.shape[2])
        return out.tobytes()

    def write_blocks(self, tier: Tier, block_ids: list[int], data: bytes) -> None:
        self._check_ids(tier, block_ids)
        expected = len(block_ids) * self.layout.block_nbytes
        if len(data) != expected:
            raise ValueError(f"expected {expected} bytes for {len(block_ids)} blocks, got {len(data)}")
        arr = np.frombuffer(data, dtype=np.uint8).reshape(self._split_shape(len(block_ids)))
        for i, b in enumerate(block_ids):
            block = arr[:, i, :]
            if block.any():
                self._blocks[(tier, b)] = block.tobytes()
            else:  # zeros are the default: keep memory proportional to real content
                self._blocks.pop((tier, b), None)

    @property
    def stored_blocks(self) -> int:
        """How many blocks currently hold non-zero bytes (memory the simulation is really using)."""
        return len(self._blocks)
