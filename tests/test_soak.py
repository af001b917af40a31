"""`hintflow soak` on real parts: the session's Temporal dev server (``temporal_env``, passed as
``--temporal``), torch engine nodes and `hintflow worker` processes that the soak starts, SIGKILLs and starts
again.

What must hold (issue 18, part 5): under chaos (at least one node and one worker killed) every program
finishes, every pool is whole at the end, the report's counts agree with each other, and no process the soak
started outlives it, whether it ends by itself or by SIGTERM mid-run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "hintflow"]


def _with(token: str) -> dict[int, str]:
    """Live processes whose command line holds ``token`` (the soak's task queue: every child's has it)."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmd and state != "Z":
            out[int(entry)] = cmd
    return out


def _spawn_soak(temporal_env: Any, tmp_path: Path, task_queue: str, *args: str) -> subprocess.Popen[str]:
    temporal = temporal_env.client.service_client.config.target_host
    with (tmp_path / "soak.err").open("w") as err:
        return subprocess.Popen(
            [*CLI, "soak", "--temporal", temporal, "--task-queue", task_queue,
             "--log-dir", str(tmp_path / "logs"), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


async def _watch_children(
    p: subprocess.Popen[str], token: str, seen: dict[int, str], err: Path, until: str = ""
) -> None:
    """Record the soak's children (polled every 0.2 s) until it exits, or until its stderr says ``until``."""
    while p.poll() is None:
        seen.update({pid: cmd for pid, cmd in _with(token).items() if pid != p.pid})
        if until and until in err.read_text():
            return
        await asyncio.sleep(0.2)


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


async def test_under_chaos_every_program_finishes_every_pool_is_whole_and_no_child_survives(
    temporal_env: Any, tmp_path: Path
) -> None:
    token = f"soak-test-{uuid.uuid4().hex[:8]}"
    # 12 s of arrivals, a chaos event every 1-3 s: the deck deals a node kill, a worker kill and a cut (a
    # node kill when no context is moving within 2 s) in the first three events, at most 11 s in.
    p = _spawn_soak(temporal_env, tmp_path, token, "--minutes", "0.2", "--chaos-interval-s", "2", "--json")
    children: dict[int, str] = {}
    try:
        await asyncio.wait_for(_watch_children(p, token, children, tmp_path / "soak.err"), 200)
        out, _ = p.communicate(timeout=30)
    finally:
        _kill(p)
    log = (tmp_path / "soak.err").read_text()
    assert p.returncode == 0, (p.returncode, log[-4000:], out[-4000:])
    r = json.loads(out)
    pr, chaos = r["programs"], r["chaos"]
    assert pr["started"] == pr["finished"] > 0 and (pr["failed"], pr["unfinished"]) == (0, 0), r
    assert chaos["num_node_kills"] >= 1 and chaos["num_worker_kills"] >= 1, (chaos, log)
    assert chaos["num_node_restarts"] == chaos["num_node_kills"], chaos
    assert chaos["num_worker_restarts"] == chaos["num_worker_kills"], chaos
    assert chaos["num_migration_cuts"] + chaos["num_cuts_not_found"] <= chaos["num_node_kills"], chaos
    assert r["model_calls"] >= pr["finished"]  # every program makes at least one model call
    assert [n["name"] for n in r["nodes"]] == ["node-0", "node-1", "node-2"]
    assert sum(n["lives"] for n in r["nodes"]) == 3 + chaos["num_node_kills"]
    for n in r["nodes"]:
        assert n["whole"], n
        assert n["free_blocks"] + n["used_blocks"] == n["pool_blocks"] == 64, n
        assert (n["used_blocks"], n["pinned_blocks"], n["in_flight"], n["sessions"]) == (0, 0, 0, 0), n
        assert n["host_free_blocks"] == n["host_pool_blocks"] == 64, n
    # Every process it started, killed ones' successors included: 3 nodes and 2 workers, then one per restart.
    assert r["num_processes_started"] == 5 + chaos["num_node_restarts"] + chaos["num_worker_restarts"], r
    assert r["verdict"].startswith("PASS"), r["verdict"]
    assert len(children) >= 5, children
    assert not _with(token), f"children outlived the soak: {_with(token)}"
    assert "Traceback" not in log, log[-4000:]


async def test_sigterm_mid_run_stops_every_child(temporal_env: Any, tmp_path: Path) -> None:
    token = f"soak-test-{uuid.uuid4().hex[:8]}"
    p = _spawn_soak(temporal_env, tmp_path, token, "--minutes", "5", "--chaos-interval-s", "2")
    children: dict[int, str] = {}
    try:
        # Running: every child served, programs arriving, the chaos loop under way.
        await asyncio.wait_for(_watch_children(p, token, children, tmp_path / "soak.err", "SIGKILL"), 120)
        assert p.poll() is None, (tmp_path / "soak.err").read_text()[-4000:]
        p.send_signal(signal.SIGTERM)
        t = time.monotonic()
        out, _ = await asyncio.to_thread(p.communicate, timeout=60)
        took = time.monotonic() - t
    finally:
        _kill(p)
    log = (tmp_path / "soak.err").read_text()
    assert p.returncode == 143, (p.returncode, log[-4000:])
    assert "hintflow soak: interrupted (SIGTERM)" in log and out == ""
    assert took < 30, took
    assert len(children) >= 5, children
    assert not _with(token), f"children outlived the soak: {_with(token)}"
    # The programs it left were terminated: the shared server is left no program that nobody serves.
    query = f"TaskQueue = '{token}' AND ExecutionStatus = 'Running'"
    deadline = time.monotonic() + 10
    while running := [w.id async for w in temporal_env.client.list_workflows(query)]:
        assert time.monotonic() < deadline, running
        await asyncio.sleep(0.5)
