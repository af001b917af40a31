"""`hintflow demo` end to end, as a user runs it (a subprocess that starts and stops its own Temporal and nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_both_modes_and_writes_table_plots_and_json(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    args = ["--programs", "3", "--turns", "3", "--nodes", "1", "--time-scale", "0.02", "--out", str(out)]
    args += ["--background-rate", "8"]  # open loop: the same competing load in both modes
    r = subprocess.run(
        [sys.executable, "-m", "hintflow", "demo", *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm-default" in r.stdout and "hintflow / vllm" in r.stdout and "competing p90 (s)" in r.stdout
    result = json.loads((out / "demo.json").read_text())
    base, ours = result["policies"]["vllm-default"], result["policies"]["hintflow"]
    for rep in (base, ours):
        assert rep["num_programs"] == 3 and rep["num_turns"] == 9
        assert rep["jct_mean_s"] > 0 and 0.0 <= rep["across_turn_hit_rate"] <= 1.0
    assert base["pins_placed"] == 0
    for rep in (base, ours):  # the competing tenants ran, and each of their requests was timed
        assert rep["background_requests"] > 0 and rep["wall_s"] > 0
        assert 0 < rep["background_latency_p50_s"] <= rep["background_latency_p90_s"]
        assert rep["config"]["background_rate"] == 8.0 and rep["config"]["background_clients"] == 0
    assert (out / "demo.png").stat().st_size > 10_000
