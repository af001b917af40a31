"""Helpers shared by the engine tests (not a test module): checks for tests that drive ``EngineCore``
directly, and a node process for the fault tests."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

from engine_adapter import EngineCore, SchedulerConfig
from hints import Release


def deadline_scheduler_config() -> SchedulerConfig:
    """Small steps, a cold-prefill cap, a 50 ms TTFT deadline and program-FCFS aging: the scheduler's
    reordering paths, for the integrity fuzzers (a fresh object each call: the config is mutable)."""
    return SchedulerConfig(
        max_num_batched_tokens=64,
        cold_prefill_budget_tokens=16,
        warm_threshold_tokens=8,
        ttft_deadline_s=0.05,
        program_fcfs_aging_s=1.0,
        admission_lookahead=2,
    )


def release_everything(core: EngineCore) -> None:
    """Release every program, free what is left, and check that every block came back."""
    core.apply_hints([Release(program_id=p) for p in sorted(core.kv.programs)])
    for s in list(core.kv.sessions.values()):
        core.kv.free_session(s)
    core.check_invariants()
    kv = core.kv
    assert kv.device.num_free_blocks == kv.device.num_blocks
    assert kv.host.num_free_blocks == kv.host.num_blocks
    assert kv.num_pinned_blocks == 0


async def spawn_node(
    node_id: str,
    log_dir: Path,
    *,
    num_device_blocks: int,
    port: int = 0,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> tuple[subprocess.Popen[str], str, Path]:
    """`hintflow engine serve` (torch executor) in a subprocess, waited for until its "serving on" line:
    (the process, its address, its log).  ``env`` is added to this process's environment."""
    log = log_dir / f"{node_id}-{uuid.uuid4().hex[:6]}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hintflow", "engine", "serve", "--executor", "torch", "--node-id", node_id,
             "--port", str(port), "--metrics-port", "-1", "--num-device-blocks", str(num_device_blocks)],
            stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
    assert proc.stdout is not None
    line = ""
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout_s)
    finally:
        if "serving on" not in line:
            proc.kill()
            proc.wait()
    m = re.fullmatch(r"hintflow engine node \S+ serving on (\S+) \(metrics off\)\n", line)
    assert m is not None, f"node {node_id} did not start ({line!r}):\n{log.read_text()[-3000:]}"
    return proc, m.group(1), log
