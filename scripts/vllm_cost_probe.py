"""What a step of a real vLLM server costs, fitted as the replay's cost model (the shape ``vllm_predict`` scales).

    python scripts/vllm_cost_probe.py [--out engine_adapter/profiles/cpu-vllm-tiny.json] [--repeats 3]

Why: ``scripts/vllm_predict.py`` replays the real node's runs with a cost model, and until this probe
that model was the ``cpu-vllm-tiny`` profile with two coefficients chosen to fit stock vLLM's latencies:
prefill linear in new tokens and no attention term, with the replay's step budget of 8,192 tokens. Stock
vLLM's turns all re-prefill whole contexts, so a linear price fitted to them charges a turn that finds its
context (a few hundred new tokens attending over thousands of cached ones) the per-token price of a
whole prompt's average. And the CPU build's server computes at most 2,048 tokens a step and admits a
turn only while its whole prompt fits (vLLM's ``scheduler_reserve_full_isl``): at that budget, with
admission on the first chunk alone, the replay's nodes preempted fifty times as often as vLLM
(``SchedulerConfig.admit_whole_prompt``, which every replay node now runs with). This probe measures the shape,
on an idle stock server of the same model, one request (or one batch) at a time:

- prefill: ``n`` fresh tokens (a prompt no earlier one shares a block with), ``max_tokens=1``, the time to
  the first streamed token; and ``n`` new tokens after ``p`` cached ones (the ``p``-token prefix sent once
  before, block-aligned, so exactly ``p`` hit). A prompt over the step budget runs as chunks, one a step,
  and each row of the fit is the sum of its chunks' terms;
- decode: ``B`` streams at a context of ``L`` tokens started together; the step is the median gap between
  one stream's tokens once every stream is decoding.

The fit is ``engine_adapter._profile.fit_nonneg`` (relative error, non-negative coefficients), the
formulas of ``engine_adapter._cost_model``. The HTTP round trip and the server's per-request work land in
``prefill_a_s``. The written profile keeps the old profile's copy cost; its step budget is vLLM's
(:data:`STEP_TOKENS`), which the replay's nodes then run with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapter import fit_nonneg
from engine_adapter.vllm_backend import (
    build_vllm_command,
    find_vllm_python,
    start_vllm,
    stop_vllm,
    wait_healthy,
)

STEP_TOKENS = 2048
"""vLLM 0.32's ``max_num_batched_tokens`` for its OpenAI server on a CPU platform (``EngineArgs``'s CPU
defaults: 2,048 per rank; 4,096 for the ``LLM`` class), which the real node's servers run with."""
BLOCK = 128
FRESH = (128, 256, 512, 1024, 1536, 2048, 3072, 4096)
AFTER = ((128, 1024), (256, 1024), (128, 2048), (256, 2048), (512, 2048), (128, 3072), (256, 3072), (512, 3584))
"""(new tokens n, cached p) pairs: a returning turn's shape on the benchmark trace (contexts of 1-4k tokens,
100-300 new tokens a turn)."""
DECODE = ((1, 256), (1, 2048), (1, 4096), (4, 1024), (4, 3072), (8, 512), (8, 2048), (16, 1024))
"""(streams B, context L) pairs."""
MAX_LEN = 4608


def _post(base: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Monotonic times of the streamed chunks that carry text (the first is the first token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    times = [time.monotonic()]
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.monotonic())
    return times


class Prompts:
    """Token ids no earlier prompt shares a block with: each starts with its own block of random ids."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab) for _ in range(n)]


def _chunks(n: int, p: int) -> list[tuple[int, int]]:
    """A prompt of ``n`` new tokens after ``p`` cached as the server runs it: (new, offset) per step."""
    out = []
    while n > 0:
        k = min(n, STEP_TOKENS)
        out.append((k, p))
        n, p = n - k, p + k
    return out


def probe(base: str, model: str, vocab: int, repeats: int, log: Any) -> dict[str, list[list[float]]]:
    prompts = Prompts(vocab)
    _post(base, model, prompts.fresh(256), 4)  # warm the server's paths once
    prefill: list[list[float]] = []
    for _ in range(repeats):
        for n in FRESH:
            t = _post(base, model, prompts.fresh(n), 1)
            prefill.append([n, 0, t[1] - t[0]])
        for n, p in AFTER:
            prefix = prompts.fresh(p)
            _post(base, model, prefix, 1)
            t = _post(base, model, prefix + prompts.fresh(n), 1)
            prefill.append([n, p, t[1] - t[0]])
        log(f"prefill: {len(prefill)} points")
    decode: list[list[float]] = []
    for _ in range(repeats):
        for b, ctx in DECODE:
            out: list[list[float]] = [[] for _ in range(b)]
            batch = [prompts.fresh(ctx) for _ in range(b)]

            def one(i: int, batch: list[list[int]] = batch, out: list[list[float]] = out) -> None:
                out[i] = _post(base, model, batch[i], 48)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(b)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            # every stream decoding: after the last stream's first token
            start = max(ts[1] for ts in out)
            gaps = [b2 - a2 for ts in out for a2, b2 in itertools.pairwise(ts[1:]) if a2 >= start]
            decode.append([b, ctx, statistics.median(gaps)])
        log(f"decode: {len(decode)} points")
    return {"prefill_n_p_s": prefill, "decode_batch_ctx_s": decode}


def fit(samples: dict[str, list[list[float]]]) -> dict[str, Any]:
    rows, ys = [], []
    for n, p, s in samples["prefill_n_p_s"]:
        parts = _chunks(int(n), int(p))
        rows.append([len(parts), sum(k for k, _ in parts), sum((o + k) ** 2 - o**2 for k, o in parts)])
        ys.append(s)
    p_coef, p_fit = fit_nonneg(np.array(rows, dtype=float), np.array(ys))
    # a decode step of B streams at context L: every stream attends over about L + 24 positions (mid-run)
    d_rows = [[1.0, b, b * (ctx + 24)] for b, ctx, _ in samples["decode_batch_ctx_s"]]
    d_coef, d_fit = fit_nonneg(np.array(d_rows), np.array([s for *_, s in samples["decode_batch_ctx_s"]]))
    return {"prefill": (p_coef, p_fit), "decode": (d_coef, d_fit)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--out", type=Path, default=root / "engine_adapter/profiles/cpu-vllm-tiny.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--model", type=Path, default=None, help="model folder [the tiny model, built if missing]")
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: at least 1")
    python = a.vllm_python or find_vllm_python()
    if python is None:
        raise SystemExit("no Python with vLLM: scripts/install.sh vllm, or --vllm-python")
    state = Path(tempfile.mkdtemp(prefix="hintflow-cost-probe-"))
    model = a.model or state / "tiny-model"
    if not (model / "config.json").exists():  # the tiny model, built by the Python that has vLLM
        subprocess.run([python, "-m", "hintflow", "make-tiny-model", str(model)], check=True, timeout=600)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with socket.socket() as sock:  # a free loopback port for the server
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    blocks = 16 * math.ceil(MAX_LEN / BLOCK) + 8  # every probe's prompts stay cached: nothing evicted
    argv, env = build_vllm_command(model, port=port, state_dir=state / "s", python=python, hintflow=False,
                                   extra_args=["--dtype", "float32", "--enforce-eager", "--max-model-len",
                                               str(MAX_LEN), "--num-gpu-blocks-override", str(blocks)])  # fmt: skip
    log_path = state / "server.log"
    proc = start_vllm(argv, env, log_path, cwd=state)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        wait_healthy(proc, base, log_path)
        samples = probe(base, str(model), vocab, a.repeats, lambda m: print(m, file=sys.stderr))
    finally:
        stop_vllm(proc)
    got = fit(samples)
    (pa, pb, pc), p_fit = got["prefill"]
    (da, dn, dc), d_fit = got["decode"]
    old = json.loads(a.out.read_text()) if a.out.exists() else {}
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    profile = {
        "name": "cpu-vllm-tiny",
        "hardware": "the CPU VM this probe ran on (2 cores), vLLM 0.32.0 CPU build, --enforce-eager, float32",
        "model": "the vLLM benchmark's tiny random-weight Llama (engine_adapter/vllm_backend/_tiny_model.py)",
        "source": f"measured by scripts/vllm_cost_probe.py on an idle stock vLLM server, {day}: prefill from the "
                  "first token of fresh and cached-prefix prompts, decode from the gaps between streamed tokens; "
                  f"step budget {STEP_TOKENS} tokens (vLLM's CPU default). scripts/vllm_predict.py scales the "
                  "prefill and decode parts to each sitting's stock run.",
        "prefill_a_s": float(pa), "prefill_b_s_per_token": float(pb), "prefill_c_s_per_token2": float(pc),
        "decode_base_s": float(da), "decode_per_seq_s": float(dn), "decode_per_ctx_token_s": float(dc),
        "copy_per_block_s": old.get("copy_per_block_s", 3.79e-06), "block_size": BLOCK,
        "max_batched_tokens": STEP_TOKENS, "kv_bytes_per_token": old.get("kv_bytes_per_token", 1024),
        "fit": {"prefill": p_fit, "decode": d_fit, **samples, "wall_s": time.monotonic() - t0},
    }  # fmt: skip
    a.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"prefill a={pa:.3e} s b={pb:.3e} s/tok c={pc:.3e} s/tok² (R² {p_fit['r2']:.3f}, median rel err "
          f"{p_fit['median_rel_err']:.1%})\ndecode base={da:.3e} s per_seq={dn:.3e} s per_ctx={dc:.3e} s "
          f"(R² {d_fit['r2']:.3f}, median rel err {d_fit['median_rel_err']:.1%})\nwrote {a.out}")


if __name__ == "__main__":
    main()
