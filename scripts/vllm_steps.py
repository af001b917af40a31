"""A vLLM node's traced steps priced by a cost profile, and a profile fitted to them.

    HINTFLOW_STEP_TRACE=DIR hintflow replay --backend vllm ...            # each server writes DIR/steps-*.jsonl
    python scripts/vllm_steps.py DIR [--names A,B,..] [--profile P.json] [--fit A,B --write-profile OUT.json]

Each trace file (``engine_adapter/vllm_backend/_step_trace.py``) is one server's life, one line per step;
files are taken in the order their servers started, which is the order of the report's ``sequence`` (name
them with ``--names``). A step's duration is the gap to the next line; gaps over ``--max-gap-s`` are the
server waiting for work, not a step, and are left out. For each file: the measured step time against the
profile's price (``CostModel.step_time``'s formula: each prefill chunk ``a + b n + c ((p+n)^2 - p^2)``, the
decodes together ``base + per_seq k + per_ctx ctx``, each block the host tier copied ``copy_per_block``),
by kind of step and by 10 s window, with the requests per step, the prefill tokens per second of steps,
the time in steps of decodes alone and, where the trace carries them, the pool's free and pinned blocks and
the queue (averages over the window's steps). ``--fit`` fits those coefficients (the
copy's only where the named steps copied blocks) by least squares on the named files' steps and
prints every file's price under the fit; ``--write-profile`` writes ``cpu-vllm-tiny`` with them, which
``scripts/vllm_predict.py --profile`` replays with instead of scaling the idle profile to the stock run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapter import CostModel

__all__ = ["COEFFICIENTS", "Step", "fit", "load_trace", "price", "profile_with", "report"]

COEFFICIENTS = ("prefill_a_s", "prefill_b_s_per_token", "prefill_c_s_per_token2",
                "decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s", "copy_per_block_s")  # fmt: skip
BASE_PROFILE = Path(__file__).resolve().parents[1] / "engine_adapter/profiles/cpu-vllm-tiny.json"

Step = tuple[float, float, list[Any]]
"""(seconds since the server's first step, measured duration, the trace line)."""


def load_trace(path: Path, max_gap_s: float = 3.0) -> tuple[dict[str, Any], list[Step]]:
    """A trace file's header and its steps that scheduled tokens (the last one has no duration: left out)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not lines or not isinstance(lines[0], dict):
        raise ValueError(f"{path}: not a step trace (its first line is not a header)")
    header, rows = lines[0], lines[1:]
    if not rows:
        return header, []
    t0 = rows[0][0]
    steps = [(a[0] - t0, b[0] - a[0], a) for a, b in itertools.pairwise(rows)
             if a[1] > 0 and b[0] - a[0] <= max_gap_s]  # fmt: skip
    return header, steps


def _copies(line: list[Any]) -> int:
    """The blocks the step's host tier copied, either way (0 in a trace from before they were recorded)."""
    return int(line[5]) + int(line[6]) if len(line) >= 7 else 0


def _features(line: list[Any]) -> list[float]:
    _, _, prefills, num_decodes, decode_ctx = line[:5]
    return [float(len(prefills)), float(sum(n for n, _ in prefills)),
            float(sum((p + n) ** 2 - p**2 for n, p in prefills)), float(num_decodes > 0), float(num_decodes),
            float(decode_ctx), float(_copies(line))]  # fmt: skip


def price(cm: CostModel, line: list[Any]) -> float:
    """The profile's price of a traced step (``CostModel.step_time``'s formula: the parts back to back)."""
    prefill = sum(cm.prefill_time(n, p) for n, p in line[2])
    return prefill + cm.decode_time(line[3], line[4]) + cm.copy_time(_copies(line))


def fit(steps: Sequence[Step]) -> dict[str, float]:
    """The coefficients (``COEFFICIENTS``) that price ``steps`` best (least squares; none below 0); the copy
    price only where some step copied blocks (else the profile keeps its own)."""
    copied = any(_copies(line) for _, _, line in steps)
    names = COEFFICIENTS if copied else COEFFICIENTS[:-1]
    if len(steps) < len(names):
        raise ValueError(f"fitting {len(names)} coefficients needs at least as many steps, got {len(steps)}")
    x = np.array([_features(line)[: len(names)] for _, _, line in steps])
    y = np.array([dt for _, dt, _ in steps])
    # No price is negative: a coefficient the fit puts below 0 is held at 0 and the rest fitted again (clipping
    # it after the fit would leave the others fitted to a price the profile does not charge)
    free = list(range(len(names)))
    while True:
        coef = np.zeros(len(names))
        coef[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        if coef.min() >= 0:
            return {k: float(v) for k, v in zip(names, coef, strict=True)}
        free.remove(int(np.argmin(coef)))


def profile_with(coefficients: dict[str, float], source: str) -> dict[str, Any]:
    """``cpu-vllm-tiny`` with the fitted coefficients."""
    base = json.loads(BASE_PROFILE.read_text())
    base.update(coefficients)
    base.update(name="fitted-steps", fit=None, source=source)
    return base


def _kind(line: list[Any]) -> str:
    n = len(line[2])
    if not n:
        return "decodes only" + (", host copies" if _copies(line) else "")
    kind = f"{min(n, 3)}{'+' if n >= 3 else ''} prefill chunk{'s' if n > 1 else ''}" + (" + decodes" if line[3] else "")
    return kind + (", host copies" if _copies(line) else "")


@dataclass
class _Window:
    """One 10 s window's sums over its steps (the window table's columns are their means)."""

    num_steps: int = 0
    measured_s: float = 0.0
    priced_s: float = 0.0
    num_tokens: int = 0
    num_requests: int = 0  # prefill chunks and decodes
    num_prefill_tokens: int = 0
    decodes_alone_s: float = 0.0  # time in steps that computed no prefill
    num_pool_lines: int = 0  # steps whose line carries the pool (``StepTrace.pool_state``; older traces do not)
    free_blocks: int = 0
    pinned_blocks: int = 0
    num_waiting: int = 0

    def add(self, dt: float, priced_s: float, line: list[Any]) -> None:
        self.num_steps += 1
        self.measured_s += dt
        self.priced_s += priced_s
        self.num_tokens += line[1]
        self.num_requests += len(line[2]) + line[3]
        self.num_prefill_tokens += sum(n for n, _ in line[2])
        self.decodes_alone_s += 0.0 if line[2] else dt
        if len(line) >= 11:  # [..., free, pinned, waiting, running]
            self.num_pool_lines += 1
            self.free_blocks += line[7]
            self.pinned_blocks += line[8]
            self.num_waiting += line[9]

    def row(self) -> str:
        """The window's cells after its time span, as the table's header names them."""
        n, r, m, p = self.num_steps, self.measured_s, self.priced_s, self.num_pool_lines
        held = f"{self.free_blocks / p:.0f} / {self.pinned_blocks / p:.0f}, {self.num_waiting / p:.1f}" if p else "-"
        return (f"{n} | {r:.1f} s | {m:.1f} s | {r / m if m else math.nan:.2f} | {self.num_tokens / n:.0f} | "
                f"{self.num_requests / n:.1f} | {self.num_prefill_tokens / r if r else math.nan:.0f} | "
                f"{self.decodes_alone_s:.1f} s | {held}")  # fmt: skip


def report(name: str, steps: Sequence[Step], cm: CostModel) -> list[str]:
    """Measured against priced, in all, by kind of step and by 10 s window."""
    if not steps:
        return [f"{name}: no step"]
    real = sum(dt for _, dt, _ in steps)
    model = sum(price(cm, line) for _, _, line in steps)
    out = [f"{name}: {len(steps)} steps, {real:.1f} s measured, {model:.1f} s priced ({real / model:.2f}x)",
           "| step | n | measured | priced | measured / priced | ms per step |", "|---|---|---|---|---|---|"]  # fmt: skip
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for _, dt, line in steps:
        k = kinds[_kind(line)]
        k[0] += 1
        k[1] += dt
        k[2] += price(cm, line)
    for kind in sorted(kinds):
        n, r, m = kinds[kind]
        out.append(f"| {kind} | {int(n)} | {r:.1f} s | {m:.1f} s | {r / m:.2f} | {1e3 * r / n:.1f} |")
    out += ["", "| window (s) | steps | measured | priced | measured / priced | tokens per step | requests per step "
            "| prefill tokens per s of steps | decodes alone | free / pinned blocks, waiting |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    wins: dict[int, _Window] = defaultdict(_Window)
    for t, dt, line in steps:
        wins[int(t // 10) * 10].add(dt, price(cm, line), line)
    for start in sorted(wins):
        out.append(f"| {start}–{start + 10} | {wins[start].row()} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--names", help="a name per trace file, in start order (default: the files' scheduler)")
    ap.add_argument("--profile", type=Path, help="the profile to price with [cpu-vllm-tiny]")
    ap.add_argument("--fit", help="fit the coefficients on these names' steps (comma-separated)")
    ap.add_argument("--write-profile", type=Path, help="with --fit: write the fitted profile here")
    ap.add_argument("--max-gap-s", type=float, default=3.0, help="a longer gap is idle, not a step [3]")
    a = ap.parse_args()
    if a.write_profile and not a.fit:
        raise SystemExit("--write-profile writes a fitted profile: name the traces to fit with --fit")
    files = sorted(a.trace_dir.glob("steps-*.jsonl"), key=lambda f: float(f.name.split("-")[1]))
    if not files:
        raise SystemExit(f"{a.trace_dir}: no steps-*.jsonl (run the servers with HINTFLOW_STEP_TRACE={a.trace_dir})")
    traces = [load_trace(f, a.max_gap_s) for f in files]
    names = a.names.split(",") if a.names else [f"{h.get('scheduler', '?')}-{i}" for i, (h, _) in enumerate(traces)]
    if len(names) != len(files):
        raise SystemExit(f"--names gives {len(names)} names for {len(files)} trace files in {a.trace_dir}")
    runs = {n: steps for n, (_, steps) in zip(names, traces, strict=True)}
    if a.fit:
        chosen = a.fit.split(",")
        unknown = sorted(set(chosen) - set(runs))
        if unknown:
            raise SystemExit(f"--fit {a.fit}: no trace named {', '.join(unknown)} (names: {', '.join(runs)})")
        coef = fit([s for n in chosen for s in runs[n]])
        profile = profile_with(coef, f"scripts/vllm_steps.py: fitted to the traced steps of {a.fit} in {a.trace_dir}")
        print("fitted: " + ", ".join(f"{k} {v:.3g}" for k, v in coef.items()))
        if a.write_profile:
            a.write_profile.write_text(json.dumps(profile, indent=1))
    else:
        profile = json.loads((a.profile or BASE_PROFILE).read_text())
    cm = CostModel.from_json(json.dumps(profile), origin="the profile")  # (validated, as load_cost_model does)
    for name, steps in runs.items():
        print("\n".join(report(name, steps, cm)) + "\n")


if __name__ == "__main__":
    main()
