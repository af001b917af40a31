"""The replay's step trace (``replay/_step_trace.py``): a replayed node writes its steps in the vLLM node's
step-trace format, which ``scripts/vllm_steps.py`` reads, and tracing changes nothing the replay reports."""

from __future__ import annotations

import json
from pathlib import Path

from replay import ReplaySetup, Simulation, get_replay_config, metrics
from tests.scripts_support import load_script


def _run(trace_dir: Path | None, policy: str = "hintflow"):  # type: ignore[no-untyped-def]
    setup = ReplaySetup(workload="swe-agent", seed=1, num_programs=20, num_nodes=1,
                        step_trace_dir=None if trace_dir is None else str(trace_dir)).with_defaults()
    programs = setup.load_programs()
    cm = setup.cost()
    setup = setup.resolve(programs, cm)
    config = get_replay_config(policy)
    spec = setup.node_spec(cm, infinite_kv=False, programs=programs)
    result = Simulation(programs, config, spec, num_nodes=1, seed=setup.seed, tick_s=setup.tick_s).run()
    m = metrics(result)
    for key in ("wall_s", "num_events"):
        m.pop(key)
    return m, result


def test_a_traced_replay_reports_the_same_and_writes_every_step(tmp_path: Path) -> None:
    plain, _ = _run(None)
    traced, result = _run(tmp_path)
    assert traced == plain
    files = list((tmp_path / "hintflow").glob("steps-*.jsonl"))
    assert [f.name for f in files] == ["steps-0-node-0.jsonl"]
    lines = files[0].read_text().splitlines()
    header, steps = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert header["node_id"] == "node-0" and header["scheduler"] == "replay:hintflow"
    assert len(steps) == result.nodes[0].num_steps  # one line per step, decode stretches included
    assert sum(s[1] for s in steps) == result.nodes[0].num_step_tokens
    times = [s[0] for s in steps]
    assert times == sorted(times)
    num_blocks = result.nodes[0].core.kv.device.num_blocks
    for _t, tokens, prefills, num_decodes, decode_ctx, loads, saves, free, pinned, waiting, running in steps:
        assert tokens == sum(n for n, _ in prefills) + num_decodes
        assert decode_ctx >= num_decodes and min(loads, saves, waiting, running) >= 0
        assert 0 <= pinned <= num_blocks and 0 <= free <= num_blocks
    assert any(s[8] > 0 for s in steps), "hintflow's node pins on this trace"


def test_the_step_reader_reads_a_replayed_trace(tmp_path: Path) -> None:
    """``scripts/vllm_steps.py`` prices a replayed node's steps under the replay's own cost model at what the
    replay charged for them (a step's duration is the gap to the next line, idle gaps left out)."""
    _, result = _run(tmp_path, "vllm-default")
    vs = load_script("vllm_steps")
    header, steps = vs.load_trace(next((tmp_path / "vllm-default").glob("steps-*.jsonl")), max_gap_s=float("inf"))
    assert header["scheduler"] == "replay:vllm-default"
    cm = result.nodes[0].cost_model
    busy = [(d, vs.price(cm, line)) for _, d, line in steps if d > 0]
    assert len(busy) > 100
    # back-to-back steps last exactly what the cost model prices them at; a step followed by an idle gap
    # lasts longer, never shorter
    assert all(d >= p - 1e-6 for d, p in busy)
    assert sum(1 for d, p in busy if abs(d - p) < 1e-6) > 0.5 * len(busy)
