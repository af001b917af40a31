"""A vLLM node with our scheduler and ``/metrics`` but no hint service (``--metrics-port`` alone).

Why its own server (the session's ``metrics-only`` one, ``tests/vllm_support.py``): the shared one in tests/test_vllm_backend.py runs the hint service, which also serves
the metrics; here the scheduler must start them itself, and no gRPC port may open. Skipped, saying why,
only where no Python with vLLM exists.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.vllm_support import ServerSpec, free_port, session_server, vllm_python_or_skip, want_server

VLLM_PYTHON = vllm_python_or_skip()


SERVER = want_server(ServerSpec(
    "metrics-only",
    ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--num-gpu-blocks-override", "24"],
    build_kw={"metrics_port": free_port()},
))  # fmt: skip


def test_metrics_without_a_hint_service(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> None:
    server = session_server("metrics-only", tmp_path_factory, pytestconfig)
    model, metrics_port = server.model, SERVER.build_kw["metrics_port"]
    assert "HINTFLOW_HINT_PORT" not in server.env
    log, base = server.log_path, server.base_url
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
