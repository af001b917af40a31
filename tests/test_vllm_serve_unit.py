"""``hintflow engine serve --backend vllm``: ``--metrics-port`` reaches vLLM's engine core as
``HINTFLOW_METRICS_PORT``; the scheduler class follows ``--async-scheduling`` (no vLLM needed: the command
is built, not run)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from engine_adapter.vllm_backend import (
    ASYNC_SCHEDULER_CLS,
    AUTO_SCHEDULER_CLS,
    SCHEDULER_CLS,
    TRACED_STOCK_SCHEDULER_CLS,
    _serve,
    build_vllm_command,
)
from hintflow.cli import hintflow


def test_metrics_port_goes_to_the_engine_core_beside_the_hint_service(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for var in ("HINTFLOW_METRICS_PORT", "HINTFLOW_HINT_PORT"):
        monkeypatch.delenv(var, raising=False)
    kw: dict[str, Any] = {"python": "python3", "state_dir": tmp_path}
    _, env = build_vllm_command("m", hint_port=9001, metrics_port=9002, **kw)
    assert env["HINTFLOW_HINT_PORT"] == "9001" and env["HINTFLOW_METRICS_PORT"] == "9002"
    _, env = build_vllm_command("m", metrics_port=0, **kw)
    assert env["HINTFLOW_METRICS_PORT"] == "0" and "HINTFLOW_HINT_PORT" not in env  # the scheduler starts them
    for off in (None, -1):
        _, env = build_vllm_command("m", metrics_port=off, **kw)
        assert "HINTFLOW_METRICS_PORT" not in env and "HINTFLOW_HINT_PORT" not in env


def test_cli_passes_metrics_port_to_serve_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(_serve, "serve_vllm", lambda model, **kw: seen.update(kw, model=model) or 0)
    args = ["engine", "serve", "--backend", "vllm", "--model", str(tmp_path), "--hint-port", "7001"]
    r = CliRunner().invoke(hintflow, [*args, "--metrics-port", "7002", "--", "--max-num-seqs", "4"])
    assert r.exit_code == 0, r.output
    assert seen["metrics_port"] == 7002 and seen["hint_port"] == 7001
    assert seen["extra_args"] == ["--max-num-seqs", "4"]
    assert seen["pin_budget"] is None  # not given: the node's own default, by its host tier
    r = CliRunner().invoke(hintflow, [*args, "--pin-budget-fraction", "0"])
    assert r.exit_code == 0, r.output
    assert seen["pin_budget"] == 0.0  # (zero is a budget, not "unset")


def test_the_pin_budget_follows_the_host_tier_unless_set() -> None:
    from engine_adapter.vllm_backend._node_defaults import PIN_BUDGET, PIN_BUDGET_WITH_HOST, pin_budget

    assert pin_budget(None, host_tier=False) == PIN_BUDGET == 0.9
    assert pin_budget("", host_tier=True) == PIN_BUDGET_WITH_HOST == 0.5
    assert pin_budget("0.6", host_tier=True) == pin_budget(" 0.6 ", host_tier=False) == 0.6
    for bad in ("1", "-0.1", "half", "nan"):
        with pytest.raises(ValueError, match="HINTFLOW_PIN_BUDGET="):
            pin_budget(bad, host_tier=False)


def test_the_defaults_that_follow_the_host_tier_are_read_from_one_place() -> None:
    """The scheduler, the harness's report and the mirror read the tier's defaults from ``node_defaults``."""
    import math

    from engine_adapter.vllm_backend import node_defaults

    device, host = node_defaults(False), node_defaults(True)
    assert (device.pin_budget, device.admit_max_wait_s, device.fcfs_slack) == (0.9, 10.0, 0.5)
    assert (host.pin_budget, host.admit_max_wait_s) == (0.5, 0.0) and math.isinf(host.fcfs_slack)


def test_node_numbers_from_the_environment_name_the_variable_on_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    from engine_adapter.vllm_backend._infer import env_float

    monkeypatch.delenv("HINTFLOW_ADMIT_FRACTION", raising=False)
    assert env_float("HINTFLOW_ADMIT_FRACTION", 1.0) == 1.0
    for raw, want in ((" ", 1.0), ("0.8", 0.8), (" inf ", math.inf)):
        monkeypatch.setenv("HINTFLOW_ADMIT_FRACTION", raw)
        assert env_float("HINTFLOW_ADMIT_FRACTION", 1.0) == want
    monkeypatch.setenv("HINTFLOW_ADMIT_FRACTION", "most")
    with pytest.raises(ValueError, match=r"HINTFLOW_ADMIT_FRACTION='most': expected a number"):
        env_float("HINTFLOW_ADMIT_FRACTION", 1.0)


def _scheduler_cls(argv: list[str]) -> str:
    assert argv.count("--scheduler-cls") == 1, argv
    return argv[argv.index("--scheduler-cls") + 1]


@pytest.mark.parametrize(
    ("flags", "cls"),
    [
        (["--async-scheduling"], ASYNC_SCHEDULER_CLS),
        (["--max-num-seqs", "4", "--async_scheduling"], ASYNC_SCHEDULER_CLS),  # vLLM reads _ as -
        (["--no-async-scheduling"], SCHEDULER_CLS),
        (["--async-scheduling", "--no-async-scheduling"], SCHEDULER_CLS),  # the last wins, as in argparse
        ([], AUTO_SCHEDULER_CLS),  # vLLM decides (on by default on CUDA, off on CPU): the engine core picks
        (["--config", "vllm.yaml"], AUTO_SCHEDULER_CLS),  # a config file may say either
    ],
)
def test_the_scheduler_class_follows_async_scheduling(tmp_path: Any, flags: list[str], cls: str) -> None:
    argv, _ = build_vllm_command("m", python="python3", state_dir=tmp_path, extra_args=flags)
    assert _scheduler_cls(argv) == cls
    assert argv[len(argv) - len(flags) :] == flags  # the user's flags reach vLLM unchanged


def test_a_given_scheduler_class_and_stock_vllm_are_left_alone(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HINTFLOW_STEP_TRACE", raising=False)
    kw: dict[str, Any] = {"python": "python3", "state_dir": tmp_path}
    argv, _ = build_vllm_command("m", extra_args=["--async-scheduling", "--scheduler-cls", "my.Sched"], **kw)
    assert _scheduler_cls(argv) == "my.Sched"
    argv, _ = build_vllm_command("m", hintflow=False, extra_args=["--async-scheduling"], **kw)
    assert "--scheduler-cls" not in argv


def test_a_traced_stock_node_runs_vllms_scheduling_through_the_traced_class(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw: dict[str, Any] = {"python": "python3", "state_dir": tmp_path, "hintflow": False}
    monkeypatch.setenv("HINTFLOW_STEP_TRACE", str(tmp_path / "steps"))
    argv, env = build_vllm_command("m", **kw)
    assert _scheduler_cls(argv) == TRACED_STOCK_SCHEDULER_CLS and env["HINTFLOW_STEP_TRACE"] == str(tmp_path / "steps")
    argv, _ = build_vllm_command("m", extra_args=["--scheduler-cls", "my.Sched"], **kw)
    assert _scheduler_cls(argv) == "my.Sched"  # a class the user gives wins
    argv, _ = build_vllm_command("m", **{**kw, "hintflow": True})
    assert _scheduler_cls(argv) == AUTO_SCHEDULER_CLS  # hintflow's scheduler traces itself


def test_cli_async_scheduling_launches_the_async_class(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """From ``hintflow engine serve ... -- --async-scheduling`` to the argv vLLM is started with."""
    launched: list[list[str]] = []

    class _Proc:
        def wait(self) -> int:
            return 0

    monkeypatch.setattr(_serve, "check_vllm_python", lambda python, env=None: "0.32.0")
    def popen(argv: list[str], **kw: Any) -> _Proc:
        launched.append(argv)
        return _Proc()

    monkeypatch.setattr(_serve.subprocess, "Popen", popen)
    args = ["engine", "serve", "--backend", "vllm", "--model", str(tmp_path), "--vllm-python", "py"]
    r = CliRunner().invoke(hintflow, [*args, "--state-dir", str(tmp_path / "s"), "--", "--async-scheduling"])
    assert r.exit_code == 0, r.output
    assert len(launched) == 1 and _scheduler_cls(launched[0]) == ASYNC_SCHEDULER_CLS


def test_a_host_tier_becomes_vllms_kv_connector_config(tmp_path: Any) -> None:
    import json

    for hintflow_scheduler in (True, False):  # the host tier works under vLLM's own scheduler too
        argv, _ = build_vllm_command(
            "m", python="python3", state_dir=tmp_path, host_capacity_tokens=4096, hintflow=hintflow_scheduler
        )
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg["kv_connector"] == "HintflowHostTier"
        assert cfg["kv_connector_extra_config"] == {"host_capacity_tokens": 4096}
    argv, _ = build_vllm_command("m", python="python3", state_dir=tmp_path)
    assert "--kv-transfer-config" not in argv
    with pytest.raises(ValueError, match="both configure vLLM's KV connector"):
        build_vllm_command(
            "m", python="python3", state_dir=tmp_path, host_capacity_tokens=4096,
            extra_args=["--kv-transfer-config", "{}"],
        )  # fmt: skip


def test_cli_host_capacity_tokens(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(_serve, "serve_vllm", lambda model, **kw: seen.update(kw) or 0)
    args = ["engine", "serve", "--backend", "vllm", "--model", str(tmp_path), "--host-capacity-tokens", "8192"]
    res = CliRunner().invoke(hintflow, args)
    assert res.exit_code == 0, res.output
    assert seen["host_capacity_tokens"] == 8192
    res = CliRunner().invoke(hintflow, ["engine", "serve", "--host-capacity-tokens", "8192"])
    assert res.exit_code == 2 and "--num-host-blocks" in res.output


def test_context_moves_keep_the_model_in_the_engine_core_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _, env = build_vllm_command("m", python="python3", state_dir=tmp_path, context_moves=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    _, env = build_vllm_command("m", python="python3", state_dir=tmp_path)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    seen: dict[str, Any] = {}
    monkeypatch.setattr(_serve, "serve_vllm", lambda model, **kw: seen.update(kw) or 0)
    res = CliRunner().invoke(hintflow, ["engine", "serve", "--backend", "vllm", "--model", str(tmp_path), "--context-moves"])
    assert res.exit_code == 0 and seen["context_moves"] is True, res.output
    res = CliRunner().invoke(hintflow, ["engine", "serve", "--context-moves"])
    assert res.exit_code == 2 and "--backend vllm" in res.output


_SUPERVISOR = """
import subprocess, sys
from engine_adapter.vllm_backend._serve import supervise
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
sys.exit(supervise(child))
"""


def test_sigterm_to_the_node_stops_the_server_it_started() -> None:
    """`hintflow engine serve --backend vllm` under SIGTERM (a service manager's stop) ends its vLLM child
    as Ctrl-C does; before, the default action ended the node alone and left the server on its port."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from engine_adapter.vllm_backend import REPO

    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    child = int(sup.stdout.readline())
    time.sleep(0.3)  # the handler is installed right after the pid is printed
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 143
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not orphaned
        os.kill(child, 0)


def test_a_dead_servers_error_keeps_the_engine_cores_root_cause() -> None:
    """The API server's own traceback (~4 kB) ends the log of an engine core that died at start: the
    excerpt keeps the core's first error above it, and the tail."""
    cause = "(EngineCore pid=7) ERROR 12-06 Failed to bind 127.0.0.1:9002: Address already in use\n"
    text = "INFO start\n" * 500 + cause + "x" * 50 + "\n" + "  File api_server.py, line 1\n" * 400 + "RuntimeError: end\n"
    out = _serve.log_excerpt(text)
    assert "Address already in use" in out and out.endswith("RuntimeError: end\n")
    assert "characters ...]" in out and len(out) < 6200 and "INFO start" not in out
    short = "INFO start\n" + cause + "RuntimeError: end\n"  # the error inside the tail: the tail alone
    assert _serve.log_excerpt(short) == short
    assert _serve.log_excerpt("INFO only\n" * 1000) == ("INFO only\n" * 1000)[-3000:]
