"""`hintflow run` and `hintflow worker` as a user runs them: real subprocesses that start (and stop) their
own Temporal dev server and torch engine node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "hintflow"]


def test_run_reports_every_program_and_turn(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    args = ["run", "coding-agent", "--programs", "2", "--set", "turns=3", "--time-scale", "0.01"]
    args += ["--background-clients", "1"]  # a closed-loop competing tenant beside them
    r = subprocess.run(CLI + args + ["--json", str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in (
        "programs",
        "pins_placed",
        "across_turn_hit_rate",
        "jct_mean_s",
        "ttft_p50_s",
        "recomputed_tokens",
    ):
        assert key in report
    assert len(report["programs"]) == 2
    assert all(p["num_turns"] == 3 and len(p["ttft_s"]) == 3 for p in report["programs"])
    # The second program shares the coding agent's system prompt with the first: some prompt was cached.
    assert sum(sum(p["cached_tokens"]) for p in report["programs"]) > 0
    assert "total: 6 turns" in r.stdout
    assert report["background_requests"] > 0 and report["background_latency_p50_s"] > 0  # the tenant was served
    assert "Temporal Server" not in r.stdout  # the dev server's banner goes to stderr, not into the report


def test_run_rejects_bad_input_clearly() -> None:
    r = subprocess.run(CLI + ["run", "no-such-agent"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown example 'no-such-agent'" in r.stderr
    r = subprocess.run(
        CLI + ["run", "coding-agent", "--set", "nope=1"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--set 'nope=1'" in r.stderr
    r = subprocess.run(
        CLI + ["run", "coding-agent", "--engines", "localhost"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "is not HOST:PORT" in r.stderr
    r = subprocess.run(
        CLI + ["run", "coding-agent", "--cost-model", "nope"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "no cost model file 'nope'" in r.stderr
    # A node nobody serves: said at once, not retried for half an hour per model call.
    r = subprocess.run(
        CLI + ["run", "coding-agent", "--engines", "127.0.0.1:1"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "engine node(s) not reachable: 127.0.0.1:1 (UNAVAILABLE" in r.stderr, r.stderr


def test_worker_starts_serves_and_stops_cleanly_on_sigint() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        CLI + ["worker", "--task-queue", "tq-cli"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if "hintflow worker: task queue" in line or not line:
                break
        assert "task queue 'tq-cli'" in line, line
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, (p.returncode, err[-3000:])
    assert "hintflow worker: stopped" in rest
    assert "PyGILState_Release" not in err and "Traceback" not in err
