"""``hintflow engine serve --backend vllm --metrics-port``: the flag reaches vLLM's engine core as
``HINTFLOW_METRICS_PORT`` (no vLLM needed: the command is built, not run)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from engine_adapter.vllm_backend import _serve
from engine_adapter.vllm_backend._serve import build_vllm_command
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
