"""scripts/vllm_cost_probe.py's fit: the server's chunking and the cost model's formulas, coefficients back.

The probe itself needs a vLLM server (minutes on this VM); its figures are on the benchmarks page. Here
its fit is checked on samples made from known coefficients, so a wrong chunk rule or formula fails."""

from __future__ import annotations

import pytest

from engine_adapter import CostModel
from tests.scripts_support import load_script


def test_a_prompt_over_the_step_budget_runs_as_chunks_one_a_step() -> None:
    probe = load_script("vllm_cost_probe")
    assert probe._chunks(1000, 0) == [(1000, 0)]
    assert probe._chunks(4096, 0) == [(2048, 0), (2048, 2048)]
    assert probe._chunks(512, 3584) == [(512, 3584)]
    assert probe._chunks(3000, 100) == [(2048, 100), (952, 2148)]


def test_the_fit_gives_back_the_coefficients_the_samples_were_made_with() -> None:
    probe = load_script("vllm_cost_probe")
    truth = CostModel(name="t", hardware="h", model="m", source="s", prefill_a_s=0.004, prefill_b_s_per_token=3e-5,
                      prefill_c_s_per_token2=2e-8, decode_base_s=0.006, decode_per_seq_s=5e-4,
                      decode_per_ctx_token_s=3e-7, copy_per_block_s=0.0, block_size=128,
                      max_batched_tokens=probe.STEP_TOKENS)  # fmt: skip
    prefill = [[n, p, sum(truth.prefill_time(k, o) for k, o in probe._chunks(n, p))]
               for n, p in [*((n, 0) for n in probe.FRESH), *probe.AFTER]]  # fmt: skip
    decode = [[b, ctx, truth.decode_time(b, b * (ctx + 24))] for b, ctx in probe.DECODE]
    got = probe.fit({"prefill_n_p_s": prefill, "decode_batch_ctx_s": decode})
    (a, b, c), p_fit = got["prefill"]
    assert (a, b, c) == pytest.approx((0.004, 3e-5, 2e-8), rel=1e-6)
    assert p_fit["r2"] == pytest.approx(1.0)
    (base, per_seq, per_ctx), _ = got["decode"]
    assert (base, per_seq, per_ctx) == pytest.approx((0.006, 5e-4, 3e-7), rel=1e-6)
