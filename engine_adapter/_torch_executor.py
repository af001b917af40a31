"""An executor that computes: a real (small) Llama-like decoder (``_torch_model``) over a paged KV cache.

The modeled executor only prices steps; this one computes them, so tests can prove that the scheduler's
block tables, prefix hits, chunking and offload/reload copies produce *the same logits* as a plain
full forward.  Weights are random but seeded, so two executors with equal configs are interchangeable
(equal ``fingerprint()``) and KV bytes moved between them stay meaningful.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import sys
import time
from typing import Any, Literal

import torch

from engine_adapter._executor import BatchChecker, CopyOp, KVLayout, ScheduledBatch, ScheduledSeq, StepOutput
from engine_adapter._torch_model import (
    DTYPES,
    MODEL_VERSION,
    Decoder,
    TorchModelConfig,
    attention,
    decode_attention,
)

__all__ = ["TorchExecutor", "TorchModelConfig", "make_torch_executor"]

Tier = Literal["device", "host"]


@functools.cache
def retain_freed_memory() -> bool:
    """Keep freed CPU memory in this process's heap (glibc; once per process; True if it took).

    On the main thread's malloc arena, glibc hands a freed buffer above its mmap threshold (adjusted
    between 128 KiB and 32 MiB) back to the OS and trims the heap top, so a CPU executor's per-step
    temporaries of a few MB fault their pages in again on every step: 16 decodes at the demo's shape
    stepped on the main thread took 12-49 ms, bimodally, and 12-16 ms with both thresholds raised.  A
    node steps on its own thread, whose arena kept its memory anyway (12-14 ms either way), so only the
    callers that step on the main thread call this: the torch replay and the profiler.  Process-wide: it
    also ends glibc's automatic threshold adjustment for every other thread.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        took = libc.mallopt(m_mmap_threshold, 32 << 20) == 1  # the top of glibc's own adjustment range
        return libc.mallopt(m_trim_threshold, 1 << 30) == 1 and took
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def _runs(copies: list[CopyOp]) -> list[list[CopyOp]]:
    """Split the ordered copies into runs of one kind with distinct destinations: inside a run nothing
    reads what another op writes, so a run moves as one batch; runs keep their order (an offload can free
    a device block that a later reload fills)."""
    runs: list[list[CopyOp]] = []
    dsts: set[int] = set()
    for op in copies:
        if not runs or runs[-1][0].kind != op.kind or op.dst in dsts:
            runs.append([])
            dsts = set()
        runs[-1].append(op)
        dsts.add(op.dst)
    return runs


def _spans(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position in ids, first id, count)`` for each stretch of consecutive ids: one host copy each."""
    spans: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if spans and spans[-1][1] + spans[-1][2] == b:
            at, first, count = spans[-1]
            spans[-1] = (at, first, count + 1)
        else:
            spans.append((i, b, 1))
    return spans


class TorchExecutor(BatchChecker):
    """Executor that owns paged KV tensors (device and host tiers) and computes real forward passes."""

    name = "torch"

    def __init__(
        self,
        config: TorchModelConfig,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        device: str | torch.device | None = None,
    ) -> None:
        if num_device_blocks < 0 or num_host_blocks < 0:
            raise ValueError("block counts must be >= 0")
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.max_model_len, self.vocab_size = config.max_model_len, config.vocab_size
        self.layout = KVLayout(
            config.num_layers, config.num_kv_heads, config.head_dim, config.block_size, config.dtype
        )
        self._dtype = DTYPES[config.dtype]
        self.model = Decoder(config).place(self.device, self._dtype).eval()
        self.device_kv = torch.zeros(self.kv_shape(num_device_blocks), dtype=self._dtype, device=self.device)
        # The host tier is block-major, [block, layer, K/V, slot, head, dim]: a block is one contiguous run of
        # bytes, so a tier copy is one DMA per stretch of consecutive blocks, where the device's layer-major
        # layout would scatter each block into 2 x layers pieces.  Pinned, so those copies run async.
        host_kv = torch.zeros(self.host_kv_shape(num_host_blocks), dtype=self._dtype)
        self.host_kv = host_kv.pin_memory() if self.device.type == "cuda" else host_kv
        # What a block copy between tiers costs here: decayed sums of copy time and blocks copied, so a
        # step's fixed cost is spread over its blocks and a one-block step does not count like a bulk one.
        self._copy_s_sum = self._copy_blocks_sum = 0.0

    @property
    def host_reload_s_per_token(self) -> float:
        """Seconds to copy one token's KV between the tiers, as measured on this node's own copies (time
        over blocks, both decayed by 0.8 a step with copies); 0 until it has copied anything, or with no
        host tier."""
        if not self.num_host_blocks or not self._copy_blocks_sum:
            return 0.0
        return self._copy_s_sum / self._copy_blocks_sum / self.config.block_size

    @property
    def tokens_embedded(self) -> int:
        """Tokens the model has run through its embedding so far (execute and reference paths)."""
        return self.model.tokens_embedded

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, num_blocks, c.block_size, c.num_kv_heads, c.head_dim)

    def host_kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The host tier's own layout (block-major); ``read_blocks``/``write_blocks`` still speak ``kv_shape``."""
        c = self.config
        return (num_blocks, c.num_layers, 2, c.block_size, c.num_kv_heads, c.head_dim)

    def fingerprint(self) -> str:
        blob = json.dumps({"model": MODEL_VERSION, **dataclasses.asdict(self.config)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # -- steps ---------------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        t0 = time.perf_counter()
        for op in batch.copies:
            self._check_copy(op)
        self._check_seqs(batch.seqs)
        sampled: dict[str, int] = {}
        logits: dict[str, object] | None = {} if batch.return_logits else None
        with torch.inference_mode():
            if batch.copies:
                self._copy(batch.copies)
            out = self._forward(batch.seqs).cpu() if batch.seqs else torch.empty(0, self.vocab_size)
        wanted = [s for s in batch.seqs if s.sample]
        for seq, row in zip(wanted, out.clone(), strict=True):  # clone: hand out ordinary tensors
            sampled[seq.request_id] = int(row.argmax())
            if logits is not None:
                logits[seq.request_id] = row
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepOutput(sampled=sampled, elapsed_s=time.perf_counter() - t0, logits=logits)

    def _copy(self, copies: list[CopyOp]) -> None:
        """Run the tier copies in order, timing them (the node reports the cost in its CacheState).

        Each run of one kind moves as a batch through a block-major staging tensor on the device: one
        gather or scatter over the device tier, one copy per stretch of consecutive host blocks.
        """
        t0 = time.perf_counter()
        to_host = (2, 0, 1, 3, 4, 5)  # [layer, K/V, block, ...] -> [block, layer, K/V, ...]
        for run in _runs(copies):
            src, dst = [op.src for op in run], [op.dst for op in run]
            if run[0].kind == "d2h":
                idx = torch.tensor(src, device=self.device)
                staged = self.device_kv[:, :, idx].permute(*to_host).contiguous()
                for at, first, count in _spans(dst):
                    self.host_kv[first : first + count].copy_(staged[at : at + count], non_blocking=True)
            else:
                staged = torch.empty(self.host_kv_shape(len(run)), dtype=self._dtype, device=self.device)
                for at, first, count in _spans(src):
                    staged[at : at + count].copy_(self.host_kv[first : first + count], non_blocking=True)
                idx = torch.tensor(dst, device=self.device)
                self.device_kv[:, :, idx] = staged.permute(1, 2, 0, 3, 4, 5)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._copy_s_sum = 0.8 * self._copy_s_sum + (time.perf_counter() - t0)
        self._copy_blocks_sum = 0.8 * self._copy_blocks_sum + len(copies)

    def _forward(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Pack all new tokens for the matmuls.  Attention: each prefill (or chunk) alone over its block
        table; the decodes (one new token over a cached context) all together, padded to the longest."""
        bs, dev = self.config.block_size, self.device
        new_slots: list[int] = []  # where each packed token's KV goes
        prefills: list[tuple[int, int, int, torch.Tensor]] = []  # (first row, end row, start_pos, ctx slots)
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        rows: list[int] = []  # rows whose logits are wanted
        row = 0
        for s in seqs:
            n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
            if s.is_decode:
                dec_rows.append(row)
                dec_tables.append(s.block_ids)
                dec_lens.append(end)
                new_slots.append(s.block_ids[(end - 1) // bs] * bs + (end - 1) % bs)
            else:
                p = torch.arange(end)
                ctx = torch.tensor(s.block_ids)[p // bs] * bs + p % bs
                prefills.append((row, row + n, s.start_pos, ctx.to(dev)))
                new_slots.extend(ctx[s.start_pos :].tolist())
            row += n
            if s.sample:
                rows.append(row - 1)
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=dev)
        pos = torch.cat([torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in seqs]).to(dev)
        slots = torch.tensor(new_slots, device=dev)
        dec_idx = dec_slots = dec_valid = None
        if dec_rows:
            c = max(dec_lens)
            width = -(-c // bs)  # a table may list more blocks than its context fills (reserved ones)
            table = torch.tensor(
                [b[:width] + [0] * (width - len(b[:width])) for b in dec_tables], dtype=torch.long
            )
            p = torch.arange(c)
            valid = p[None, :] < torch.tensor(dec_lens)[:, None]
            # Padding reads the sequence's own first slot and is masked out.  Not a shared slot such as 0: a
            # masked score still adds up, and NaN or inf KV in a block nobody owns would poison every row.
            slots2d = table[:, p // bs] * bs + p % bs
            dec_slots = torch.where(valid, slots2d, slots2d[:, :1]).to(dev)
            dec_valid = None if min(dec_lens) == c else valid[:, None, None, :].to(dev)
            dec_idx = torch.tensor(dec_rows, device=dev)
        kvh, hd = self.config.num_kv_heads, self.config.head_dim

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache = self.device_kv[layer, 0].view(-1, kvh, hd)
            v_cache = self.device_kv[layer, 1].view(-1, kvh, hd)
            k_cache[slots], v_cache[slots] = k, v
            if not prefills and dec_slots is not None:  # decodes only: rows are the decodes, in order
                return decode_attention(q, k_cache[dec_slots], v_cache[dec_slots], dec_valid)
            out = torch.empty_like(q)
            for a, b, start, ctx in prefills:
                out[a:b] = attention(q[a:b], k_cache[ctx], v_cache[ctx], start)
            if dec_idx is not None and dec_slots is not None:
                out[dec_idx] = decode_attention(q[dec_idx], k_cache[dec_slots], v_cache[dec_slots], dec_valid)
            return out

        return self.model(ids, pos, attend, torch.tensor(rows, dtype=torch.long, device=dev))

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Last-position logits of a plain full forward (no paging, fresh KV): the ground truth."""
        self._check_seq(ScheduledSeq("reference", list(token_ids), 0, [], True), set(), check_blocks=False)
        n = len(token_ids)

        def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v, None)

        with torch.inference_mode():
            ids = torch.tensor(token_ids, device=self.device)
            pos = torch.arange(n, device=self.device)
            rows = torch.tensor([n - 1], device=self.device)
            out = self.model(ids, pos, attend, rows)[0].cpu()
        return out.clone()  # outside inference mode: callers get an ordinary tensor

    # -- validation ----------------------------------------------------------------------------------

    def _check_ids(self, tier: Tier, block_ids: list[int]) -> torch.Tensor:
        limit = {"device": self.num_device_blocks, "host": self.num_host_blocks}.get(tier)
        if limit is None:
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        bad = [b for b in block_ids if not 0 <= b < limit]
        if bad:
            raise ValueError(f"{tier} block id {bad[0]} out of range [0, {limit})")
        return torch.tensor(block_ids, dtype=torch.long)

    # -- raw KV transfer -----------------------------------------------------------------------------

    def _tier(self, tier: Tier) -> torch.Tensor:
        return self.device_kv if tier == "device" else self.host_kv

    def read_blocks(self, tier: Tier, block_ids: list[int]) -> bytes:
        idx = self._check_ids(tier, block_ids)
        if tier == "host":
            data = self.host_kv[idx].permute(1, 2, 0, 3, 4, 5).contiguous()
        else:
            data = self.device_kv[:, :, idx.to(self.device)].cpu().contiguous()
        return data.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, tier: Tier, block_ids: list[int], data: bytes) -> None:
        idx = self._check_ids(tier, block_ids)
        expected = len(block_ids) * self.layout.block_nbytes
        if len(data) != expected:
            raise ValueError(f"expected {expected} bytes for {len(block_ids)} blocks, got {len(data)}")
        kv = self._tier(tier)
        raw = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        src = raw.view(self._dtype).reshape(self.kv_shape(len(block_ids)))
        with torch.inference_mode():
            if tier == "host":
                kv[idx] = src.permute(2, 0, 1, 3, 4, 5)
            else:
                kv[:, :, idx.to(kv.device)] = src.to(kv.device)


def make_torch_executor(
    num_device_blocks: int = 256,
    num_host_blocks: int = 0,
    device: str | torch.device | None = None,
    **config_fields: Any,
) -> TorchExecutor:
    """Build an executor from flat keyword arguments (config fields mixed with block counts)."""
    return TorchExecutor(TorchModelConfig(**config_fields), num_device_blocks, num_host_blocks, device)
