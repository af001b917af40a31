"""Measure a TorchExecutor and fit a CostModel to it, so the modeled executor's clock is grounded.

Each point is a real ``TorchExecutor.execute`` call: one-shot prefills, chunked prefills at an offset,
decode steps of B sequences at a given context, and d2h/h2d copies of N blocks; the median of ``repeats``
interleaved rounds, each timed call right after an untimed one (see ``_measure``).  Coefficients come
from ``numpy.linalg.lstsq`` on *relative* error (each row weighted by 1/t): step times span three orders
of magnitude, and an unweighted fit lets the longest prefill decide everything and misses short steps by
multiples (even with negative intercepts).  A negative coefficient is clamped to 0 and the rest refit.
R² (on the unweighted times) and relative errors are kept in the JSON under ``fit``, with every raw
sample, so a fit can be judged or redone.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from engine_adapter._cost_model import CostModel
from engine_adapter._executor import CopyOp, ScheduledBatch, ScheduledSeq
from engine_adapter._torch_executor import TorchExecutor, TorchModelConfig, retain_freed_memory

__all__ = ["FULL_PLAN", "LARGE_PLAN", "PLANS", "QUICK_PLAN", "ProfilePlan", "fit_nonneg", "profile_torch_executor"]

_PREFILL_NOTE = (
    "the (p+n)^2-p^2 form describes causal kernels that skip masked tiles (FlashAttention, SDPA's fused "
    "kernels); TorchExecutor runs those since it gives SDPA 4-D inputs (before, the math kernel computed "
    "the whole n x (p+n) score rectangle and long one-shot prefills cost 2-2.5x what the fit said)"
)


@dataclasses.dataclass(frozen=True)
class ProfilePlan:
    """Which points to measure.  ``chunks`` are (new tokens n, cached offset p) pairs."""

    lengths: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # positions each decode seq attends over (start_pos + 1)
    copy_blocks: tuple[int, ...]


# With the tiny model on one CPU thread: quick ~1-2 s, full ~5-10 s (x repeats/3).
QUICK_PLAN = ProfilePlan(
    lengths=(16, 64, 128, 256, 512, 768, 1024),
    chunks=((128, 256), (256, 256), (256, 512), (256, 768), (512, 512)),
    decode_batches=(1, 4, 8, 16),
    decode_contexts=(32, 256, 1024),
    copy_blocks=(1, 8, 32),
)
FULL_PLAN = ProfilePlan(
    lengths=(16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048),
    chunks=((128, 512), (256, 256), (256, 1024), (256, 1536), (512, 512), (512, 1024), (512, 1536)),
    decode_batches=(1, 2, 4, 8, 16, 32),
    decode_contexts=(16, 256, 1024, 2048),
    copy_blocks=(1, 4, 16, 64, 128),
)
# A real-size model on a GPU (an 8B shape in bf16 on one H200): the replay's steps, one-shot prefills up to
# the 8,192-token step budget, chunks at offsets into a 24k context, decodes of up to 64 sequences.  The
# executor holds every decode point's blocks at once: 64 x 8,192 positions, 64 GiB of an 8B model's KV at
# 128 KiB a token, beside 16 GB of weights.  Needs max_model_len >= 24,576.
LARGE_PLAN = ProfilePlan(
    lengths=(128, 512, 1024, 2048, 4096, 6144, 8192),
    chunks=((512, 2048), (2048, 2048), (2048, 8192), (4096, 4096), (4096, 12288), (8192, 8192),
            (8192, 16384)),
    decode_batches=(1, 4, 16, 32, 64),
    decode_contexts=(256, 2048, 8192),
    copy_blocks=(1, 16, 64, 256),
)
PLANS = {"quick": QUICK_PLAN, "full": FULL_PLAN, "large": LARGE_PLAN}
"""The plans by name (``hintflow engine profile --plan``)."""


def fit_nonneg(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Least squares of ``x @ coef ≈ y`` on relative error, coefficients clamped at 0; plus fit quality."""
    w = 1.0 / y
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], np.ones_like(y), rcond=None)
        coef[:] = 0.0
        coef[active] = sol
        if (sol >= 0).all():
            break
        active = [c for c, v in zip(active, sol, strict=True) if v > 0]  # drop negatives, refit the rest
    pred = x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / y
    return coef, {"r2": r2, "median_rel_err": float(np.median(rel)), "max_rel_err": float(rel.max())}


def profile_torch_executor(
    config: TorchModelConfig | None = None,
    lengths: Sequence[int] | None = None,
    decode_batches: Sequence[int] | None = None,
    decode_contexts: Sequence[int] | None = None,
    chunks: Sequence[tuple[int, int]] | None = None,
    copy_blocks: Sequence[int] | None = None,
    repeats: int = 3,
    quick: bool = False,
    plan: str | None = None,
    device: str | None = "cpu",
    threads: int | None = None,
    clock: Literal["wall", "cpu"] | None = None,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> CostModel:
    """Time real steps of a fresh TorchExecutor and fit a CostModel; unset point lists use the plan
    (``plan`` by name from :data:`PLANS`; else quick or full by ``quick``).

    ``threads`` pins torch's intra-op threads for the run (restored after).  On a small shared CPU one
    thread gives stable numbers: with every core requested, a neighbour's process stalls each parallel
    region and single steps get many times slower.

    ``clock``: ``"wall"`` times each call with ``perf_counter``; ``"cpu"`` with this process's CPU time,
    which a neighbour's load cannot inflate (time spent descheduled is not counted).  CPU time equals
    the step's wall time only when one thread does all the work, so the default is ``"cpu"`` for a
    one-thread CPU profile and ``"wall"`` otherwise.
    """
    t_start = time.perf_counter()
    cfg = config or TorchModelConfig()
    if plan is not None and plan not in PLANS:
        raise ValueError(f"unknown profile plan {plan!r}; known: {', '.join(PLANS)}")
    plan_name = plan or ("quick" if quick else "full")
    base = PLANS[plan_name]
    points_plan = ProfilePlan(
        tuple(lengths or base.lengths),
        tuple(chunks if chunks is not None else base.chunks),
        tuple(decode_batches or base.decode_batches),
        tuple(decode_contexts or base.decode_contexts),
        tuple(copy_blocks or base.copy_blocks),
    )
    _validate(points_plan, cfg, repeats, threads)
    before = torch.get_num_threads()
    if clock is None:
        clock = "cpu" if (threads or before) == 1 and _resolve(device).type == "cpu" else "wall"
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    torch.set_num_threads(threads or before)
    try:
        if _resolve(device).type == "cpu":
            retain_freed_memory()  # steps on this thread: keep each step's temporaries' pages (see there)
        ex, batches, points = _build(points_plan, cfg, device)
        (progress or (lambda _m: None))(
            f"timing {len(batches)} steps x {repeats} rounds (each after a warm-up call)"
        )
        times = _measure(ex, batches, repeats, time.process_time if clock == "cpu" else time.perf_counter)
        hardware = _hardware(ex.device)
    finally:
        torch.set_num_threads(before)
    pre = [(n, p, t) for (kind, n, p), t in zip(points, times, strict=True) if kind == "prefill"]
    dec = [(b, b * c, t) for (kind, b, c), t in zip(points, times, strict=True) if kind == "decode"]
    cps = [(kind, n, t) for (kind, n, _), t in zip(points, times, strict=True) if kind in ("d2h", "h2d")]
    p_coef, p_fit = fit_nonneg(np.array([[1.0, n, (p + n) ** 2 - p**2] for n, p, _ in pre]), _ys(pre))
    d_coef, d_fit = fit_nonneg(np.array([[1.0, b, ctx] for b, ctx, _ in dec]), _ys(dec))
    c_coef, c_fit = fit_nonneg(np.array([[1.0, n] for _, n, _ in cps]), _ys(cps))

    duration = time.perf_counter() - t_start
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    how = f"{plan_name} plan, median of {repeats}, {clock} clock"
    tiny = dataclasses.replace(cfg, seed=0) == TorchModelConfig()
    size = "tiny" if tiny else f"h{cfg.hidden_size}-l{cfg.num_layers}"
    fit: dict[str, Any] = {
        "method": "numpy.linalg.lstsq on relative error (rows weighted 1/t); negatives clamped to 0, refit",
        "quick": plan_name == "quick",
        "plan": plan_name,
        "repeats": repeats,
        "clock": clock,
        "duration_s": round(duration, 2),
        "config": dataclasses.asdict(cfg),
        "prefill": {**p_fit, "note": _PREFILL_NOTE, "samples_n_p_s": [list(s) for s in pre]},
        "decode": {**d_fit, "samples_batch_totalctx_s": [list(s) for s in dec]},
        "copy": {
            **c_fit,
            "step_overhead_s": float(c_coef[0]),  # intercept: an empty step's cost, not a copy's
            "samples_kind_blocks_s": [list(s) for s in cps],
        },
    }
    return CostModel(
        name=name or f"{ex.device.type}-{size}",
        hardware=hardware,
        model=(
            f"hintflow torch Llama-like, random weights: hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
            f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {cfg.dtype}"
        ),
        source=f"measured by `hintflow engine profile` ({how}) on {hardware}, {day}",
        prefill_a_s=float(p_coef[0]),
        prefill_b_s_per_token=float(p_coef[1]),
        prefill_c_s_per_token2=float(p_coef[2]),
        decode_base_s=float(d_coef[0]),
        decode_per_seq_s=float(d_coef[1]),
        decode_per_ctx_token_s=float(d_coef[2]),
        copy_per_block_s=float(c_coef[1]),
        block_size=cfg.block_size,
        max_batched_tokens=max(points_plan.lengths),  # the fit has seen one-shot steps up to this size
        kv_bytes_per_token=ex.layout.block_nbytes // cfg.block_size,
        fit=fit,
    )


def _validate(plan: ProfilePlan, cfg: TorchModelConfig, repeats: int, threads: int | None) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    sizes = plan.lengths + plan.decode_batches + plan.decode_contexts + plan.copy_blocks
    if not plan.lengths or min(sizes, default=0) < 1 or any(n < 1 or p < 0 for n, p in plan.chunks):
        raise ValueError("profile lengths, batches, contexts and block counts must be positive")
    longest = max([*plan.lengths, *(n + p for n, p in plan.chunks), *plan.decode_contexts])
    if longest > cfg.max_model_len:
        raise ValueError(f"profile needs {longest} positions, config max_model_len={cfg.max_model_len}")


Point = tuple[Literal["prefill", "decode", "d2h", "h2d"], int, int]


def _build(
    plan: ProfilePlan, cfg: TorchModelConfig, device: str | None
) -> tuple[TorchExecutor, list[ScheduledBatch], list[Point]]:
    """An executor just big enough for the plan, and one batch per point (block tables from block 0)."""
    bs = cfg.block_size
    longest = max([*plan.lengths, *(n + p for n, p in plan.chunks)])
    nb_dec = _blocks(max(plan.decode_contexts), bs)
    need = max(_blocks(longest, bs), max(plan.decode_batches) * nb_dec, max(plan.copy_blocks))
    ex = TorchExecutor(cfg, num_device_blocks=need, num_host_blocks=max(plan.copy_blocks), device=device)
    points: list[Point] = [("prefill", n, 0) for n in plan.lengths] + [
        ("prefill", n, p) for n, p in plan.chunks
    ]
    points += [("decode", b, c) for b in plan.decode_batches for c in plan.decode_contexts]
    points += [(k, n, 0) for k in ("d2h", "h2d") for n in plan.copy_blocks]
    batches: list[ScheduledBatch] = []
    for kind, x, y in points:
        if kind == "prefill":
            batches.append(
                ScheduledBatch([ScheduledSeq("p", [1] * x, y, list(range(_blocks(x + y, bs))), True)])
            )
        elif kind == "decode":
            nb = _blocks(y, bs)
            seqs = [
                ScheduledSeq(f"d{i}", [1], y - 1, list(range(i * nb, (i + 1) * nb)), True) for i in range(x)
            ]
            batches.append(ScheduledBatch(seqs))
        else:
            batches.append(ScheduledBatch(copies=[CopyOp(kind, i, i) for i in range(x)]))
    return ex, batches, points


def _measure(
    ex: TorchExecutor, batches: list[ScheduledBatch], repeats: int, timer: Callable[[], float]
) -> list[float]:
    """Median time per batch over ``repeats`` interleaved rounds.

    Rounds interleave the points (alternating direction), so a neighbour's burst of load is spread over
    many points instead of landing on every repeat of one point and bending the fit.  Each timed call
    follows an untimed call of the same batch: steady-state serving repeats similar steps, and without
    it a small decode timed right after a long prefill pays for the caches the prefill evicted.
    """
    order = list(range(len(batches)))
    samples: list[list[float]] = [[] for _ in batches]
    for r in range(repeats):
        for i in order if r % 2 == 0 else order[::-1]:
            ex.execute(batches[i])
            t0 = timer()
            ex.execute(batches[i])
            samples[i].append(timer() - t0)
    return [statistics.median(s) for s in samples]


def _ys(rows: Sequence[tuple[Any, ...]]) -> np.ndarray:
    return np.array([r[-1] for r in rows], dtype=float)


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    plural = "" if threads == 1 else "s"
    return f"{cpu} CPU, {os.cpu_count()} cores, {threads} torch thread{plural} (torch {torch.__version__})"


def _resolve(device: str | None) -> torch.device:
    """The device TorchExecutor will pick for ``device`` (None: CUDA when present)."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
