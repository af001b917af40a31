"""The vLLM node's step trace (``_step_trace.py``) and ``scripts/vllm_steps.py``, which prices and fits it.

A trace needs a vLLM server (its figures are on the benchmarks page); here the trace's line is read from a
scheduler output of vLLM's shape, and the fit is checked on steps priced by known coefficients, so a step
misread, a formula that differs from ``CostModel.step_time``'s, or a fit that returns the wrong
coefficient fails."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter import CostModel
from engine_adapter._executor import CopyOp, ScheduledBatch, ScheduledSeq
from engine_adapter.vllm_backend import _step_trace
from tests.scripts_support import load_script


def _output(new: list[tuple[str, int]], cached: list[tuple[str, int]], scheduled: dict[str, int]) -> Any:
    """A ``SchedulerOutput`` as vLLM 0.32 builds it (the fields the trace reads)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
    )  # fmt: skip


def test_a_step_line_tells_prefill_chunks_from_decodes() -> None:
    out = _output(new=[("a", 256), ("b", 0)], cached=[("c", 1000), ("d", 2048), ("e", 70)],
                  scheduled={"a": 512, "b": 1, "c": 1, "d": 300})  # fmt: skip
    t, tokens, prefills, num_decodes, ctx, loads, saves = _step_trace.step_line(out, 12.5)
    assert (t, tokens) == (12.5, 814)
    assert prefills == [[512, 256], [1, 0], [300, 2048]]  # a one-token prompt is a prefill, not a decode
    assert (num_decodes, ctx) == (1, 1001)  # "e" was not scheduled this step
    assert (loads, saves) == (0, 0)  # no host tier


def test_a_step_line_counts_the_host_tiers_copies() -> None:
    out = _output(new=[("a", 256)], cached=[], scheduled={"a": 512})
    meta = SimpleNamespace(loads=[(3, 7), (4, 8)], saves=[(9, 1), (10, 2), (11, 3)])
    assert _step_trace.step_line(out, 1.0, meta)[5:] == [2, 3]  # handed in by the connector
    out.kv_connector_metadata = meta  # attached by vLLM once the connector built it
    assert _step_trace.step_line(out, 1.0)[5:] == [2, 3]


def test_the_trace_writes_a_header_and_each_step_once(tmp_path: Path) -> None:
    trace = _step_trace.StepTrace(tmp_path / "t.jsonl", {"scheduler": "hintflow"})
    first = _output([("a", 0)], [], {"a": 128})
    trace.record(first)
    trace.record(first)  # the connector and the scheduler both saw it
    trace.record(_output([], [("a", 128)], {"a": 1}))
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines[0] == {"scheduler": "hintflow"} and len(lines) == 3 and trace.num_steps == 2
    assert lines[1][2] == [[128, 0]] and lines[2][3:] == [1, 129, 0, 0]
    trace.record(SimpleNamespace())  # a step it cannot read stops the trace, it does not raise
    assert trace._file.closed and trace.num_steps == 2
    trace.record(first)  # and nothing more is written
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 3


def test_a_step_whose_output_reuses_a_freed_outputs_address_is_still_written(tmp_path: Path) -> None:
    # vLLM frees each step's SchedulerOutput before it builds the next, and CPython often puts the next at
    # the freed address: a trace that compared id()s dropped ~3% of a loaded node's steps
    class Output:  # built as vLLM builds its output: the object first, then what it holds
        pass

    trace = _step_trace.StepTrace(tmp_path / "t.jsonl", {"scheduler": "vllm"})
    for i in range(50):
        out = Output()
        vars(out).update(vars(_output([], [("a", 128 + i)], {"a": 1})))
        trace.record(out)
        del out  # freed (unless the trace holds it) before the next step's output is built
    ctx = [json.loads(x)[4] for x in (tmp_path / "t.jsonl").read_text().splitlines()[1:]]
    assert trace.num_steps == 50 and ctx == list(range(129, 179))
    trace.close()


def test_an_unwritable_trace_directory_leaves_tracing_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HINTFLOW_STEP_TRACE", str(blocker / "traces"))
    monkeypatch.setattr(_step_trace, "_TRIED", False)
    monkeypatch.setattr(_step_trace, "_TRACE", None)
    with caplog.at_level(logging.WARNING):
        assert _step_trace.step_trace("hintflow") is None
    assert "cannot write the step trace" in caplog.text
    assert _step_trace.step_trace("vllm") is None  # asked once per process, not every step
    monkeypatch.setenv("HINTFLOW_STEP_TRACE", str(tmp_path / "traces"))
    monkeypatch.setattr(_step_trace, "_TRIED", False)
    trace = _step_trace.step_trace("hintflow", "n0")
    assert trace is not None and trace is _step_trace.step_trace("vllm")  # one file per process
    assert json.loads(trace.path.read_text().splitlines()[0])["scheduler"] == "hintflow"
    trace.close()


def _steps(cm: CostModel, n: int, seed: int = 0, copies: bool = True) -> list[tuple[float, float, list[Any]]]:
    """Steps of random shapes, each lasting what ``cm.step_time`` prices the same batch at."""
    rng, steps = random.Random(seed), []
    for i in range(n):
        prefills = [[rng.randint(1, 2048), rng.choice([0, rng.randint(1, 4000)])] for _ in range(rng.randint(0, 3))]
        contexts = [rng.randint(100, 4000) for _ in range(rng.randint(0 if prefills else 1, 8))]  # with its new token
        loads, saves = (rng.randint(0, 12), rng.randint(0, 12)) if copies and rng.random() < 0.3 else (0, 0)
        line = [0.1 * i, sum(n for n, _ in prefills) + len(contexts), prefills, len(contexts), sum(contexts),
                loads, saves]  # fmt: skip
        batch = ScheduledBatch(
            [ScheduledSeq(f"p{j}", [0] * n, p, [], True) for j, (n, p) in enumerate(prefills)]
            + [ScheduledSeq(f"d{j}", [0], c - 1, [], True) for j, c in enumerate(contexts)],
            [CopyOp("h2d", j, j) for j in range(loads)] + [CopyOp("d2h", j, j) for j in range(saves)],
        )  # fmt: skip
        steps.append((0.1 * i, cm.step_time(batch), line))
    return steps


def test_a_traced_step_is_priced_as_the_cost_model_prices_its_batch() -> None:
    vs = load_script("vllm_steps")
    profile = json.loads(vs.BASE_PROFILE.read_text())
    cm = CostModel(**{k: v for k, v in profile.items() if k in CostModel.model_fields})
    steps = _steps(cm, 300)
    assert any(line[2] and line[3] for _, _, line in steps)  # mixed steps among them
    assert any(line[5] for _, _, line in steps)  # and steps that copy blocks
    for _, dt, line in steps:
        assert vs.price(cm, line) == pytest.approx(dt, rel=1e-9)


def test_the_fit_finds_the_coefficients_that_priced_the_steps() -> None:
    vs = load_script("vllm_steps")
    truth = {"prefill_a_s": 0.012, "prefill_b_s_per_token": 3e-5, "prefill_c_s_per_token2": 1e-8,
             "decode_base_s": 0.005, "decode_per_seq_s": 4e-4, "decode_per_ctx_token_s": 6e-7,
             "copy_per_block_s": 2e-4}  # fmt: skip
    cm = CostModel(**{k: v for k, v in vs.profile_with(truth, "test").items() if k in CostModel.model_fields})
    steps = [(t, vs.price(cm, line), line) for t, _, line in _steps(cm, 400, seed=1)]
    got = vs.fit(steps)
    for k, v in truth.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    # steps that copied nothing (no host tier, or a trace from before copies were recorded) leave the copy
    # price to the profile
    plain = [(t, vs.price(cm, line), line[:5]) for t, _, line in _steps(cm, 400, seed=2, copies=False)]
    assert "copy_per_block_s" not in vs.fit(plain) and vs.fit(plain)["decode_base_s"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="at least as many steps"):
        vs.fit(steps[:3])


def test_a_trace_file_gives_durations_and_leaves_idle_gaps_out(tmp_path: Path) -> None:
    vs = load_script("vllm_steps")
    rows = [{"scheduler": "vllm"}, [10.0, 512, [[512, 0]], 0, 0], [10.2, 1, [], 1, 513], [10.21, 0, [], 0, 0],
            [10.3, 1, [], 1, 514], [30.0, 300, [[300, 0]], 0, 0], [30.1, 1, [], 1, 301]]  # fmt: skip
    path = tmp_path / "steps-1.0-7.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    header, steps = vs.load_trace(path)
    assert header == {"scheduler": "vllm"}
    # the empty step is left out, so is the 19.7 s gap (the server waited for work) and the last line
    assert [(round(t, 2), round(dt, 2)) for t, dt, _ in steps] == [(0.0, 0.2), (0.2, 0.01), (20.0, 0.1)]
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not a step trace"):
        vs.load_trace(tmp_path / "bad.jsonl")
    text = "\n".join(vs.report("x", steps, CostModel(**{k: v for k, v in json.loads(vs.BASE_PROFILE.read_text()).items()
                                                        if k in CostModel.model_fields})))  # fmt: skip
    assert text.startswith("x: 3 steps, 0.3 s measured") and "| decodes only | 1 |" in text


def test_the_pool_and_the_queue_go_on_each_line_and_into_the_windows(tmp_path: Path) -> None:
    """Where the scheduler tells the trace its pool and queue (``StepTrace.pool_state``), each line carries
    them after the copies, and ``vllm_steps.py`` averages them per window (a line without them counts none)."""
    trace = _step_trace.StepTrace(tmp_path / "steps-1.0-7.jsonl", {"scheduler": "hintflow"})
    state = [[40, 30, 5, 4]]
    trace.pool_state = lambda: state[0]
    trace.record(_output([("a", 0)], [], {"a": 128}))
    state[0] = [10, 50, 7, 6]
    trace.record(_output([], [("a", 128)], {"a": 1}))
    trace.pool_state = None
    trace.record(_output([], [("a", 129)], {"a": 1}))
    trace.close()
    lines = [json.loads(x) for x in (tmp_path / "steps-1.0-7.jsonl").read_text().splitlines()[1:]]
    assert lines[0][7:] == [40, 30, 5, 4] and lines[1][7:] == [10, 50, 7, 6] and len(lines[2]) == 7
    vs = load_script("vllm_steps")
    steps = [(0.0, 0.1, lines[0]), (0.1, 0.1, lines[1]), (0.2, 0.1, lines[2]), (12.0, 0.1, lines[2])]
    cm = CostModel(**{k: v for k, v in json.loads(vs.BASE_PROFILE.read_text()).items() if k in CostModel.model_fields})
    rows = [r for r in vs.report("x", steps, cm) if r.startswith("| 0–10") or r.startswith("| 10–20")]
    # 128 prefill tokens in 0.3 s of steps, two of them decodes alone; the pool of the two lines that said
    assert rows[0].endswith("| 427 | 0.2 s | 25 / 40, 6.0 |")
    assert rows[1].endswith("| 0.1 s | - |")  # no line of that window carried them
