"""The one seam between the KV scheduler and whatever computes a step.

The scheduler decides *what* runs in a step and *where* its KV lives; an executor only computes::

    ScheduledBatch                                  StepOutput
    +-----------------------------+                 +---------------------------+
    | copies: [CopyOp, ...]       |  --execute-->   | sampled: {req_id: token}  |
    |   d2h / h2d, in list order  |                 | elapsed_s                 |
    | seqs:   [ScheduledSeq, ...] |                 | logits (torch, on demand) |
    +-----------------------------+                 +---------------------------+

Copies run first, in order (an offload may free a device block that a reload in the same step then
fills), then the forward pass over every scheduled sequence.  A sequence names the device blocks that
hold its KV for positions ``[0, start_pos + len(token_ids))``: positions ``< start_pos`` are already
there (cached prefix or earlier chunks), the new tokens' KV is written into the same table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "BatchChecker",
    "Clock",
    "CopyOp",
    "Executor",
    "KVLayout",
    "MonotonicClock",
    "ScheduledBatch",
    "ScheduledSeq",
    "StepOutput",
    "VirtualClock",
]


class Clock(Protocol):
    """The node's own clock: leases and hint deadlines are measured on it, never on a peer's."""

    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulated time: the modeled executor advances it by each step's modeled duration."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError(f"cannot move a clock backwards (dt_s={dt_s})")
        self._now += dt_s

    def advance_to(self, t_s: float) -> None:
        self._now = max(self._now, t_s)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block; two nodes can exchange contexts only when their layouts match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"

    @property
    def block_nbytes(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CopyOp:
    kind: Literal["d2h", "h2d"]  # d2h: device block src -> host block dst; h2d: host src -> device dst
    src: int
    dst: int


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens computed this step: a prefill chunk, or one decode token
    start_pos: int  # tokens already in the KV cache for this sequence
    block_ids: list[int]  # device block table covering positions [0, start_pos + len(token_ids))
    sample: bool  # sample the next token after this step (last prefill chunk, or decode)
    context_len_hint: int = 0  # total prompt length, for cost models that price a chunk by its context

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token after a computed context: priced and run with the step's other decodes (one weight
        read for all); anything else is a prefill chunk (the cost model, the torch executor, the step trace)."""
        return len(self.token_ids) == 1 and self.start_pos > 0


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    return_logits: bool = False  # tests ask the torch executor for the last position's logits

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def is_empty(self) -> bool:
        return not self.seqs and not self.copies


@dataclass
class StepOutput:
    sampled: dict[str, int]  # request_id -> next token, for seqs with sample=True
    elapsed_s: float  # time the step took (measured on torch, modeled on the modeled executor)
    logits: dict[str, object] | None = None  # request_id -> 1-D logits tensor, when return_logits


@runtime_checkable
class Executor(Protocol):
    """Computes steps; owns the KV tensors (device and host tiers), never the block accounting."""

    name: str
    layout: KVLayout
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int

    def execute(self, batch: ScheduledBatch) -> StepOutput: ...

    def read_blocks(self, tier: Literal["device", "host"], block_ids: list[int]) -> bytes:
        """KV of the given blocks, concatenated in order, as raw bytes (layout: see ``kv_shape``)."""
        ...

    def write_blocks(self, tier: Literal["device", "host"], block_ids: list[int], data: bytes) -> None: ...

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the tensor that ``read_blocks`` returns for ``num_blocks`` blocks."""
        ...

    def fingerprint(self) -> str:
        """Identifies model weights and KV layout: contexts move only between equal fingerprints."""
        ...


class BatchChecker:
    """Batch validation shared by the torch and modeled executors.

    Both executors must reject the same scheduler bugs the same way (same checks, same messages):
    otherwise a bug caught in a torch test could slip through a modeled simulation, or the reverse.
    Subclasses set ``num_device_blocks``, ``num_host_blocks``, ``vocab_size``, ``max_model_len`` and
    ``layout`` (its ``block_size`` sizes block tables), and implement ``_check_ids``.
    """

    num_device_blocks: int
    num_host_blocks: int
    vocab_size: int
    max_model_len: int
    layout: KVLayout

    def _check_ids(self, tier: Literal["device", "host"], block_ids: list[int]) -> object:
        """Raise ``ValueError`` unless every id is a valid block of ``tier``."""
        raise NotImplementedError

    def _check_copy(self, op: CopyOp) -> None:
        if op.kind not in ("d2h", "h2d"):
            raise ValueError(f"unknown copy kind {op.kind!r}")
        src_n, dst_n = (
            (self.num_device_blocks, self.num_host_blocks)
            if op.kind == "d2h"
            else (self.num_host_blocks, self.num_device_blocks)
        )
        if not (0 <= op.src < src_n and 0 <= op.dst < dst_n):
            raise ValueError(f"{op.kind} copy {op.src}->{op.dst} out of range (src<{src_n}, dst<{dst_n})")

    def _check_seqs(self, seqs: list[ScheduledSeq]) -> None:
        """Per-seq checks, plus: no two seqs write new KV into the same block (a scheduler bug)."""
        seen: set[str] = set()
        writers: dict[int, str] = {}
        bs = self.layout.block_size
        for seq in seqs:
            self._check_seq(seq, seen)
            for b in seq.block_ids[seq.start_pos // bs : -(-(seq.start_pos + len(seq.token_ids)) // bs)]:
                if writers.setdefault(b, seq.request_id) != seq.request_id:
                    raise ValueError(f"requests {writers[b]!r} and {seq.request_id!r} both write block {b}")

    def _check_seq(self, seq: ScheduledSeq, seen: set[str], check_blocks: bool = True) -> None:
        rid, n = seq.request_id, len(seq.token_ids)
        if rid in seen:
            raise ValueError(f"request {rid!r} scheduled twice in one batch")
        seen.add(rid)
        if n == 0 or seq.start_pos < 0:
            raise ValueError(
                f"request {rid!r}: needs >= 1 token and start_pos >= 0 (start_pos={seq.start_pos})"
            )
        bad = [t for t in seq.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: token id {bad[0]} outside [0, {self.vocab_size})")
        end = seq.start_pos + n
        if end > self.max_model_len:
            raise ValueError(f"request {rid!r}: {end} positions exceed max_model_len={self.max_model_len}")
        if not check_blocks:
            return
        need = -(-end // self.layout.block_size)
        if len(seq.block_ids) < need:
            raise ValueError(
                f"request {rid!r}: block table has {len(seq.block_ids)} blocks, "
                f"positions [0, {end}) need {need}"
            )
        self._check_ids("device", seq.block_ids[:need])
        if len(set(seq.block_ids[:need])) < need:
            raise ValueError(f"request {rid!r}: block table repeats a block: {seq.block_ids[:need]}")
