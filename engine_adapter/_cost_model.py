"""What a step costs, as a few coefficients: the modeled executor's clock and Continuum's PrefillReload.

One JSON file per (hardware, model).  Bundled ones live in ``engine_adapter/profiles/``; measured ones
come from ``hintflow engine profile``.  The formulas, with ``n`` new tokens, ``p`` cached tokens::

    prefill chunk   a + b·n + c·((p+n)² − p²)
    decode step     base + per_seq·B + per_ctx·Σ ctx_i          (ctx_i = start_pos_i + 1)
    copy            copy_per_block · blocks
    step            prefills + decodes + reloads + offloads   (offload_overlaps_compute false)
                    max(prefills + decodes + reloads, offloads)  (offload_overlaps_compute true)

Why price a chunk at offset ``p`` with ``(p+n)² − p²``: attention of ``n`` queries over ``p+n`` keys is
the slice of the full causal square between rows ``p`` and ``p+n``, so the quadratic term telescopes and
``k`` chunks of a prompt cost exactly its one-shot prefill plus ``(k−1)·a``.  The model charges chunking
only its real overhead (one more step's fixed cost), so a scheduler comparing chunk sizes in simulation
sees the same trade-off a real engine has, and a single coefficient ``c`` serves both cases.

Why offloads may overlap: a GPU engine stores KV to host on the copy engine, on its own CUDA stream beside
the step's kernels (vLLM's offloading connector, SGLang's HiCache that KVFlow builds on, LMCache), so a
device-to-host copy costs the step nothing until the copy engine itself is the bottleneck.  A reload is
different: the turn that needs it cannot compute before its blocks arrive, so it stays on the critical
path (a ``Prefetch`` is how it leaves it).  The embedded engine offloads a block when it evicts it; a GPU
engine would have written it behind earlier, so only the copy engine's time is charged.  The torch executor
on a CPU copies inline, so the profile it fits (``cpu-tiny``) keeps every copy on the critical path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine_adapter._executor import ScheduledBatch

__all__ = ["PROFILES_DIR", "CostModel", "bundled_profiles", "load_cost_model"]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

_NonNeg = Field(ge=0, allow_inf_nan=False)


class CostModel(BaseModel):
    """Coefficients (seconds) of the step-time formulas above; frozen so a running node can't drift."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    hardware: str
    model: str
    source: str  # where the numbers come from: a profiler run or the published figures they derive from
    prefill_a_s: float = _NonNeg
    prefill_b_s_per_token: float = _NonNeg
    prefill_c_s_per_token2: float = _NonNeg
    decode_base_s: float = _NonNeg
    decode_per_seq_s: float = _NonNeg
    decode_per_ctx_token_s: float = _NonNeg
    copy_per_block_s: float = _NonNeg  # one block host<->device, either direction
    # device->host copies run beside the step's compute (see the module docstring); False: inline
    offload_overlaps_compute: bool = False
    block_size: int = Field(ge=1)
    max_batched_tokens: int = Field(ge=1)  # per-step token budget the coefficients are valid up to
    kv_bytes_per_token: int | None = Field(default=None, ge=1)  # documents how copy cost was derived
    fit: dict[str, Any] | None = None  # profiler metadata: R² per part, samples, duration

    # -- formulas ------------------------------------------------------------------------------------

    def prefill_time(self, n: int, p: int = 0) -> float:
        """One prefill chunk of ``n`` new tokens after ``p`` cached ones (``n == 0`` costs nothing)."""
        if n < 0 or p < 0:
            raise ValueError(f"prefill_time needs n >= 0 and p >= 0, got n={n}, p={p}")
        if n == 0:
            return 0.0
        quad = (p + n) ** 2 - p**2
        return self.prefill_a_s + self.prefill_b_s_per_token * n + self.prefill_c_s_per_token2 * quad

    def decode_time(self, batch_size: int, total_ctx: int) -> float:
        """One decode step of ``batch_size`` sequences attending over ``total_ctx`` positions in all."""
        if batch_size < 0 or total_ctx < 0:
            raise ValueError(f"decode_time needs non-negative inputs, got {batch_size=}, {total_ctx=}")
        if batch_size == 0:
            return 0.0
        return (
            self.decode_base_s + self.decode_per_seq_s * batch_size + self.decode_per_ctx_token_s * total_ctx
        )

    def copy_time(self, num_blocks: int) -> float:
        """Host<->device transfer of ``num_blocks`` KV blocks (what reloading an offloaded context costs)."""
        if num_blocks < 0:
            raise ValueError(f"copy_time needs num_blocks >= 0, got {num_blocks}")
        return self.copy_per_block_s * num_blocks

    def step_time(self, batch: ScheduledBatch) -> float:
        """Modeled duration of one executor step.

        A seq with exactly one new token and ``start_pos > 0`` is a decode: all decodes are priced together
        by the decode formula (they share one weight read), with ``ctx = start_pos + 1``.  Every other seq
        is a prefill chunk priced on its own by ``prefill_time(len, start_pos)``.  Copies cost
        ``copy_per_block_s`` each.  The parts add up: a mixed step is priced as if its parts ran back to
        back, which over-prices piggybacked decodes slightly but never makes a step cheaper than its
        largest part.  With ``offload_overlaps_compute`` the device->host copies run beside the rest
        and the step lasts the longer of the two.  ``context_len_hint`` is ignored: the formula needs
        only what is already cached.
        """
        num_offloads = sum(1 for op in batch.copies if op.kind == "d2h") if self.offload_overlaps_compute else 0
        total = self.copy_time(len(batch.copies) - num_offloads)
        dec_n = dec_ctx = 0
        for s in batch.seqs:
            n = len(s.token_ids)
            if s.is_decode:
                dec_n += 1
                dec_ctx += s.start_pos + 1
            else:
                total += self.prefill_time(n, s.start_pos)
        return max(total + self.decode_time(dec_n, dec_ctx), self.copy_time(num_offloads))

    def prefill_reload_s(self, num_tokens: int) -> float:
        """Recomputing a whole context from nothing (Continuum's PrefillReload).

        Priced as the engine would run it: chunks of ``max_batched_tokens``, i.e. the one-shot cost plus
        one extra ``a`` per additional chunk, so the pin-or-drop decision sees what the recompute costs.
        """
        if num_tokens < 0:
            raise ValueError(f"prefill_reload_s needs num_tokens >= 0, got {num_tokens}")
        if num_tokens == 0:
            return 0.0
        chunks = math.ceil(num_tokens / self.max_batched_tokens)
        return self.prefill_time(num_tokens) + (chunks - 1) * self.prefill_a_s

    # -- files ---------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=True) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "<json>") -> CostModel:
        """Parse and validate; a ``ValueError`` names the offending field (and where it came from)."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            problems = "; ".join(
                f"field {'.'.join(str(x) for x in err['loc']) or '<root>'!r}: {err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"{origin}: invalid cost model: {problems}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def bundled_profiles() -> list[str]:
    """Names accepted by ``load_cost_model`` without a path."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_cost_model(path_or_name: str | Path) -> CostModel:
    """Load a cost model from a JSON file path, or by the name of a bundled profile (``h100-llama3-8b``)."""
    path = Path(path_or_name)
    if not path.is_file():
        bundled = PROFILES_DIR / f"{path_or_name}.json"
        if isinstance(path_or_name, str) and "/" not in path_or_name and bundled.is_file():
            path = bundled
        else:
            raise ValueError(
                f"no cost model file {str(path_or_name)!r} and no bundled profile of that name "
                f"(bundled: {', '.join(bundled_profiles())})"
            )
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read cost model {path}: {e.strerror or e}") from None
    return CostModel.from_json(text, origin=str(path))
