"""The cost model prices steps by its documented formulas, the modeled executor validates and moves KV
bytes like the torch executor, and the profiler fits a cost model that predicts real torch steps."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from engine_adapter import (
    CopyOp,
    CostModel,
    Executor,
    KVLayout,
    ModeledExecutor,
    ScheduledBatch,
    ScheduledSeq,
    TorchExecutor,
    TorchModelConfig,
    bundled_profiles,
    load_cost_model,
    profile_torch_executor,
)

A, B, C = 1e-3, 1e-5, 1e-8
BASE, PER_SEQ, PER_CTX, COPY = 2e-3, 1e-4, 1e-7, 5e-5


@pytest.fixture
def cm() -> CostModel:
    return CostModel(
        name="unit",
        hardware="none",
        model="none",
        source="hand-made for tests",
        prefill_a_s=A,
        prefill_b_s_per_token=B,
        prefill_c_s_per_token2=C,
        decode_base_s=BASE,
        decode_per_seq_s=PER_SEQ,
        decode_per_ctx_token_s=PER_CTX,
        copy_per_block_s=COPY,
        block_size=16,
        max_batched_tokens=256,
    )


@pytest.fixture
def ex(cm: CostModel) -> ModeledExecutor:
    return ModeledExecutor(cm, num_device_blocks=32, num_host_blocks=8, max_model_len=1024)


def seq(rid: str, n: int, start: int, blocks: list[int], sample: bool = True, tok: int = 1) -> ScheduledSeq:
    return ScheduledSeq(rid, [tok] * n, start, blocks, sample)


# -- cost model arithmetic ---------------------------------------------------------------------------


def test_prefill_and_chunked_prefill(cm: CostModel) -> None:
    assert cm.prefill_time(100) == pytest.approx(A + 100 * B + 100**2 * C)  # 2.1e-3
    assert cm.prefill_time(100) == pytest.approx(2.1e-3)
    assert cm.prefill_time(100, 50) == pytest.approx(A + 100 * B + (150**2 - 50**2) * C)  # 2.2e-3
    assert cm.prefill_time(100, 50) == pytest.approx(2.2e-3)
    assert cm.prefill_time(0, 10) == 0.0
    chunks = [(100, 0), (150, 100), (50, 250)]  # 300 tokens in three chunks
    assert sum(cm.prefill_time(n, p) for n, p in chunks) == pytest.approx(cm.prefill_time(300) + 2 * A)
    with pytest.raises(ValueError, match="n >= 0"):
        cm.prefill_time(-1)


def test_decode_copies_and_reload(cm: CostModel) -> None:
    assert cm.decode_time(4, 1000) == pytest.approx(BASE + 4 * PER_SEQ + 1000 * PER_CTX)  # 2.5e-3
    assert cm.decode_time(4, 1000) == pytest.approx(2.5e-3)
    assert cm.decode_time(0, 0) == 0.0
    assert cm.copy_time(3) == pytest.approx(1.5e-4)
    assert cm.prefill_reload_s(0) == 0.0
    assert cm.prefill_reload_s(200) == pytest.approx(cm.prefill_time(200))  # one chunk
    assert cm.prefill_reload_s(600) == pytest.approx(cm.prefill_time(600) + 2 * A)  # 3 chunks of <= 256


def test_mixed_step(cm: CostModel) -> None:
    batch = ScheduledBatch(
        seqs=[
            seq("prefill", 100, 0, []),
            seq("chunk", 50, 100, []),
            seq("one-token-prompt", 1, 0, []),  # start_pos 0: a prefill, not a decode
            seq("dec1", 1, 10, []),  # ctx 11
            seq("dec2", 1, 20, []),  # ctx 21
        ],
        copies=[CopyOp("d2h", 0, 0), CopyOp("h2d", 1, 1)],
    )
    expected = (
        cm.prefill_time(100, 0)
        + cm.prefill_time(50, 100)
        + cm.prefill_time(1, 0)
        + (BASE + 2 * PER_SEQ + 32 * PER_CTX)
        + 2 * COPY
    )
    assert cm.step_time(batch) == pytest.approx(expected)
    assert cm.step_time(ScheduledBatch()) == 0.0


def test_modeled_node_reports_its_cost_model_s_copy_back(cm: CostModel) -> None:
    """The CacheState's host_reload_s_per_token is the clock's own copy cost, 0 without a host tier."""
    from engine_adapter import EngineCore

    with_tier = ModeledExecutor(cm, num_device_blocks=8, num_host_blocks=4)
    assert with_tier.host_reload_s_per_token == pytest.approx(COPY / 16)
    assert ModeledExecutor(cm, num_device_blocks=8).host_reload_s_per_token == 0.0
    assert EngineCore(with_tier).cache_state().host_reload_s_per_token == pytest.approx(COPY / 16)


def test_offloads_overlap_compute_when_the_profile_says_so(cm: CostModel) -> None:
    """GPU profiles run device->host copies beside the step: a step costs the longer of its compute (with
    reloads, which the turn waits for) and its offloads; inline (the default) they add up."""
    overlapped = cm.model_copy(update={"offload_overlaps_compute": True})
    decode = seq("dec", 1, 99, [])  # ctx 100
    compute = BASE + PER_SEQ + 100 * PER_CTX
    few = ScheduledBatch(seqs=[decode], copies=[CopyOp("d2h", 0, 0), CopyOp("h2d", 1, 1)])
    assert cm.step_time(few) == pytest.approx(compute + 2 * COPY)
    assert overlapped.step_time(few) == pytest.approx(compute + COPY)  # the offload is hidden
    many = ScheduledBatch(seqs=[decode], copies=[CopyOp("d2h", i, i) for i in range(200)])
    assert compute < 200 * COPY
    assert overlapped.step_time(many) == pytest.approx(200 * COPY)  # the copy engine is the bottleneck
    assert overlapped.step_time(ScheduledBatch(copies=[CopyOp("d2h", 0, 0)])) == pytest.approx(COPY)
    assert load_cost_model("h100-llama3-8b").offload_overlaps_compute
    assert not load_cost_model("cpu-tiny").offload_overlaps_compute  # torch on a CPU copies inline


# -- files -------------------------------------------------------------------------------------------


def test_bundled_profiles_load() -> None:
    names = bundled_profiles()
    assert {"h100-llama3-8b", "a100-llama3-8b", "cpu-tiny"} <= set(names)
    for name in names:
        m = load_cost_model(name)
        assert m.name == name and m.source and m.prefill_b_s_per_token > 0 and m.decode_base_s > 0
        assert CostModel.from_json(m.to_json()) == m
    h100, a100 = load_cost_model("h100-llama3-8b"), load_cost_model("a100-llama3-8b")
    assert "not measured" in h100.source.lower() and h100.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert 10_000 <= 2048 / h100.prefill_time(2048) <= 15_000  # the published range it comes from
    assert a100.prefill_time(2048) > h100.prefill_time(2048)
    assert a100.decode_time(1, 1) > h100.decode_time(1, 1)
    tiny = load_cost_model("cpu-tiny")
    assert tiny.fit is not None and "measured by `hintflow engine profile`" in tiny.source


def test_load_by_path_and_errors(cm: CostModel, tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    cm.save(path)
    assert load_cost_model(path) == cm == load_cost_model(str(path))
    data = json.loads(cm.to_json())
    changes: list[tuple[dict[str, object], str]] = [
        ({"prefill_b_s_per_token": -1.0}, "prefill_b_s_per_token"),
        ({"block_size": 0}, "block_size"),
        ({"decode_base_s": "fast"}, "decode_base_s"),
        ({"copy_per_blok_s": 1.0}, "copy_per_blok_s"),  # typo: unknown fields are rejected
    ]
    for change, field in changes:
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(ValueError, match=field):
            load_cost_model(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "max_batched_tokens"}))
    with pytest.raises(ValueError, match="max_batched_tokens"):
        load_cost_model(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="invalid cost model"):
        load_cost_model(path)
    with pytest.raises(ValueError, match="h100-llama3-8b"):  # the message lists what is bundled
        load_cost_model("no-such-profile")
    with pytest.raises(ValueError):
        cm.prefill_a_s = 0.0  # type: ignore[misc]  # frozen


# -- modeled executor --------------------------------------------------------------------------------


def test_protocol_and_time(ex: ModeledExecutor, cm: CostModel) -> None:
    assert isinstance(ex, Executor) and ex.name == "modeled"
    assert ex.layout == KVLayout(2, 2, 8, 16, "float16")
    batch = ScheduledBatch([seq("a", 40, 0, [0, 1, 2]), seq("b", 1, 20, [3, 4])], [CopyOp("d2h", 5, 0)])
    out = ex.execute(batch)
    assert out.elapsed_s == pytest.approx(cm.step_time(batch)) and out.logits is None
    assert set(out.sampled) == {"a", "b"} and all(0 <= t < 512 for t in out.sampled.values())
    assert ex.execute(ScheduledBatch([seq("c", 3, 0, [0], sample=False)])).sampled == {}
    with pytest.raises(ValueError, match="block_size"):
        ModeledExecutor(cm, 4, layout=KVLayout(2, 2, 8, 32, "float16"))


def test_deterministic_sampling(cm: CostModel) -> None:
    def run(e: ModeledExecutor) -> list[int]:
        return [e.execute(ScheduledBatch([seq("r", 1, p, [0, 1])])).sampled["r"] for p in range(1, 30)]

    a, b = ModeledExecutor(cm, 4), ModeledExecutor(cm, 4)
    assert run(a) == run(b) == run(a)
    assert len(set(run(a))) > 20  # varies with position
    assert run(ModeledExecutor(cm, 4, seed=1)) != run(a)
    other = [a.execute(ScheduledBatch([seq(f"r{i}", 1, 5, [0])])).sampled[f"r{i}"] for i in range(20)]
    assert len(set(other)) > 10  # varies with the request id


@pytest.mark.parametrize(
    ("seqs", "match"),
    [
        ([seq("a", 2, 0, [0], tok=512)], "token id 512"),
        ([seq("a", 2, 0, [0], tok=-1)], "token id -1"),
        ([seq("a", 8, 1020, list(range(64)))], "exceed max_model_len"),
        ([seq("a", 20, 0, [0])], "need 2"),
        ([seq("a", 2, 0, [32])], "device block id 32"),
        ([seq("a", 20, 0, [1, 1])], "repeats a block"),
        ([seq("a", 0, 0, [0])], ">= 1 token"),
        ([seq("a", 2, 0, [0]), seq("a", 2, 0, [1])], "scheduled twice"),
        ([seq("a", 2, 0, [0]), seq("b", 2, 0, [0])], "both write block 0"),
    ],
)
def test_validation(ex: ModeledExecutor, seqs: list[ScheduledSeq], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ex.execute(ScheduledBatch(seqs))


def test_copy_and_transfer_validation(ex: ModeledExecutor) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ex.execute(ScheduledBatch(copies=[CopyOp("d2h", 0, 8)]))
    with pytest.raises(ValueError, match="out of range"):
        ex.execute(ScheduledBatch(copies=[CopyOp("h2d", 8, 0)]))
    with pytest.raises(ValueError, match="tier"):
        ex.read_blocks("disk", [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host block id 8"):
        ex.read_blocks("host", [8])
    with pytest.raises(ValueError, match="expected"):
        ex.write_blocks("device", [0], b"\x01" * 10)


def _random_bytes(ex: ModeledExecutor, n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n * ex.layout.block_nbytes, dtype=np.uint8).tobytes()


def test_bytes_round_trip_and_copies(ex: ModeledExecutor, cm: CostModel) -> None:
    nb = ex.layout.block_nbytes
    assert ex.read_blocks("device", [0, 1]) == bytes(2 * nb)  # never written: zeros
    data = _random_bytes(ex, 2)
    ex.write_blocks("device", [3, 5], data)
    assert ex.read_blocks("device", [3, 5]) == data
    # Reordered read follows the torch layout [layers, K/V, blocks, ...]: the block axis is swapped.
    swapped = np.frombuffer(data, np.uint8).reshape(4, 2, -1)[:, ::-1].tobytes()
    assert ex.read_blocks("device", [5, 3]) == swapped
    # Offload to host, then reload into different device blocks (same step, in order).
    ex.execute(ScheduledBatch(copies=[CopyOp("d2h", 3, 0), CopyOp("d2h", 5, 1)]))
    assert ex.read_blocks("host", [0, 1]) == data
    ex.execute(ScheduledBatch(copies=[CopyOp("d2h", 9, 1), CopyOp("h2d", 0, 7), CopyOp("h2d", 1, 8)]))
    assert ex.read_blocks("device", [7]) == ex.read_blocks("device", [3])
    assert ex.read_blocks("device", [8]) == bytes(nb)  # host 1 was overwritten by empty device 9 first
    # Export from one modeled node, import into another.
    peer = ModeledExecutor(cm, 16)
    peer.write_blocks("device", [0, 1], ex.read_blocks("device", [3, 5]))
    assert peer.read_blocks("device", [0, 1]) == data and peer.fingerprint() == ex.fingerprint()
    ex.write_blocks("device", [3, 5], bytes(2 * nb))
    assert ex.read_blocks("device", [3, 5]) == bytes(2 * nb)


def test_layout_matches_torch_executor(cm: CostModel) -> None:
    cfg = TorchModelConfig(hidden_size=16, num_heads=2, num_kv_heads=2, dtype="float16", max_model_len=64)
    tex = TorchExecutor(cfg, num_device_blocks=4, device="cpu")
    mex = ModeledExecutor(cm, 4, layout=tex.layout)
    assert mex.kv_shape(3) == tex.kv_shape(3)
    data = _random_bytes(mex, 3, seed=1)
    tex.write_blocks("device", [0, 1, 2], data)
    mex.write_blocks("device", [0, 1, 2], data)
    for ids in ([2], [1, 0], [0, 2, 1]):
        assert mex.read_blocks("device", ids) == tex.read_blocks("device", ids)
    other = load_cost_model("h100-llama3-8b")
    assert ModeledExecutor(other, 4).fingerprint() != ModeledExecutor(cm, 4).fingerprint()
    assert mex.fingerprint() == ModeledExecutor(cm, 4).fingerprint()  # it is the default layout
    wider = ModeledExecutor(cm, 4, layout=KVLayout(2, 2, 8, 16, "float32"))
    assert wider.fingerprint() != mex.fingerprint()


# -- profiler ----------------------------------------------------------------------------------------


def test_quick_profile_predicts_held_out_prefill() -> None:
    prof = profile_torch_executor(quick=True, threads=1)  # one thread: CPU-time clock, immune to neighbours
    assert prof.fit is not None and prof.fit["clock"] == "cpu"
    for field in ("prefill_b_s_per_token", "prefill_c_s_per_token2", "decode_per_seq_s", "copy_per_block_s"):
        assert getattr(prof, field) > 0, field
    assert prof.prefill_a_s >= 0 and prof.decode_base_s + prof.decode_per_ctx_token_s > 0
    # Fused causal attention fits the (p+n)²-p² form (R² 0.99 here; the unfused math kernel gave 0.5-0.8).
    assert prof.fit["prefill"]["r2"] > 0.9 and prof.fit["prefill"]["median_rel_err"] < 0.2
    # Batched decode steps of the tiny model are mostly fixed cost, so their spread is small and one slow
    # sample (the first process's page faults land in its CPU time) moves R² a lot (0.56-0.999 over
    # runs); the median relative error is the steadier check (0.01-0.07; 0.17 once, in a clean-clone CI
    # run on the loaded 2-core VM, 2026-12-02: CPU time still moves with cache contention).
    assert prof.fit["decode"]["r2"] > 0.3 and prof.fit["decode"]["median_rel_err"] < 0.3
    # Copies are short and few, so one slow sample moves their R² too (0.51 in one clean-clone CI run on a
    # loaded 2-core VM, 2026-12-01; above 0.7 in the others).
    assert prof.fit["copy"]["r2"] > 0.3
    assert 384 not in [n for n, _, _ in prof.fit["prefill"]["samples_n_p_s"]]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tex = TorchExecutor(TorchModelConfig(), num_device_blocks=24, device="cpu")
        batch = ScheduledBatch([seq("held-out", 384, 0, list(range(24)))])
        samples = []
        for _ in range(5):
            tex.execute(batch)  # the profiler times each call after an untimed one, so do the same
            t0 = time.process_time()
            tex.execute(batch)
            samples.append(time.process_time() - t0)
        measured = statistics.median(samples)
    finally:
        torch.set_num_threads(before)
    assert 0.5 < prof.prefill_time(384) / measured < 2.0


def test_cli_profile(tmp_path: Path) -> None:
    from hintflow.cli import hintflow

    out = tmp_path / "p.json"
    result = CliRunner().invoke(
        hintflow, ["engine", "profile", "--out", str(out), "--quick", "--threads", "1", "--repeats", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "R²" in result.output and load_cost_model(out).name == "cpu-tiny"


def test_profile_plans_by_name_and_the_large_plan_s_needs(tmp_path: Path) -> None:
    """``--plan`` picks the points; the large one (a real-size model on a GPU, scripts/device_profile.sh)
    needs a 24k-position model, and says so before building anything; an unknown name lists the known."""
    from engine_adapter._profile import LARGE_PLAN, PLANS, _validate
    from hintflow.cli import hintflow

    assert set(PLANS) == {"quick", "full", "large"}
    _validate(LARGE_PLAN, TorchModelConfig(max_model_len=24576), 1, None)
    with pytest.raises(ValueError, match="max_model_len=4096"):
        _validate(LARGE_PLAN, TorchModelConfig(), 1, None)
    with pytest.raises(ValueError, match="known: quick, full, large"):
        profile_torch_executor(plan="huge")
    out = tmp_path / "p.json"
    result = CliRunner().invoke(hintflow, ["engine", "profile", "--out", str(out), "--plan", "large"])
    assert result.exit_code != 0 and "max_model_len=4096" in result.output  # a usage error, nothing built
    result = CliRunner().invoke(
        hintflow, ["engine", "profile", "--out", str(out), "--plan", "quick", "--threads", "1", "--repeats", "1"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["fit"]["plan"] == "quick"


def test_device_profile_script_runs_its_path_on_a_cpu(tmp_path: Path) -> None:
    """scripts/device_profile.sh's `run` (meant for a lent GPU) on this CPU with the tiny shape and the quick
    plan: it writes the profile and its log where the device tool collects them."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "PROFILE_DEVICE": "cpu", "PROFILE_SHAPE": "--max-model-len 4096"}
    r = subprocess.run(["bash", str(root / "scripts" / "device_profile.sh"), "run", "--plan", "quick", "--threads",
                        "1", "--repeats", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    prof = load_cost_model(tmp_path / "h200-llama3-8b.json")
    assert prof.fit is not None and prof.fit["plan"] == "quick" and prof.decode_base_s > 0
    assert "wrote" in (tmp_path / "profile.log").read_text()


def test_profile_on_a_device_this_machine_lacks_is_a_usage_error() -> None:
    import torch

    from hintflow.cli import hintflow

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    res = CliRunner().invoke(hintflow, ["engine", "profile", "--out", "/tmp/never.json", "--device", "cuda"])
    assert res.exit_code == 2 and "device 'cuda' is not usable here" in res.output, res.output
