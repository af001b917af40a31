"""A vLLM node with our scheduler and ``/metrics`` but no hint service (``--metrics-port`` alone).

Why its own server: the shared one in tests/test_vllm_backend.py runs the hint service, which also serves
the metrics; here the scheduler must start them itself, and no gRPC port may open. Skipped, saying why,
only where no Python with vLLM exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from tests.vllm_support import free_port, vllm_python_or_skip

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = vllm_python_or_skip()

from engine_adapter.vllm_backend._serve import build_vllm_command, start_vllm, stop_vllm, wait_healthy  # noqa: E402


def test_metrics_without_a_hint_service(tmp_path: Path) -> None:
    assert VLLM_PYTHON is not None
    model = tmp_path / "model"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([VLLM_PYTHON, "-m", "hintflow", "make-tiny-model", str(model)], check=True, timeout=300, env=env)
    http_port, metrics_port = free_port(), free_port()
    state = Path(tempfile.mkdtemp(prefix="hfm-"))  # vLLM's IPC socket paths must stay under 107 bytes
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--num-gpu-blocks-override", "24"]
    argv, env = build_vllm_command(
        model, port=http_port, metrics_port=metrics_port, state_dir=state, python=VLLM_PYTHON,
        extra_args=flags,
    )  # fmt: skip
    assert "HINTFLOW_HINT_PORT" not in env
    log = tmp_path / "server.log"
    proc = start_vllm(argv, env, log, cwd=tmp_path)
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_healthy(proc, base, log, timeout_s=150)
        body = {"model": str(model), "prompt": list(range(10, 310)), "max_tokens": 2,
                "vllm_xargs": {"program_id": "p"}}  # fmt: skip
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["choices"]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        lines = {  # name -> value of each hintflow_* sample (labels dropped: one model here)
            line.split("{", 1)[0].split(" ", 1)[0]: line.rsplit(" ", 1)[1]
            for line in text.splitlines()
            if line.startswith("hintflow_")
        }
        assert float(lines["hintflow_kv_total_blocks"]) == 23  # 24 less vLLM's reserved null block
        assert float(lines["hintflow_num_requests_running"]) == 0.0
        assert "hintflow hint service" not in log.read_text()
    finally:
        stop_vllm(proc)
        shutil.rmtree(state, ignore_errors=True)
