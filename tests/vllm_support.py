"""What the tests against a real vLLM share: the Python that has vLLM (or a skip saying why), a free
loopback port, and a Prometheus scrape as {(sample name, labels without model_name): value}."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.vllm_backend._serve import find_vllm_python  # no vLLM import: safe here

__all__ = ["NO_VLLM", "free_port", "scrape_metrics", "vllm_python_or_skip"]

NO_VLLM = "no Python with vLLM: run scripts/install.sh vllm (creates .venv-vllm) or set HINTFLOW_VLLM_PYTHON"


def vllm_python_or_skip() -> str:
    """The Python with vLLM; skips the calling module (or test) with :data:`NO_VLLM` where there is none."""
    python = find_vllm_python()
    if python is None:
        pytest.skip(NO_VLLM, allow_module_level=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out
