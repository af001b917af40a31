"""What the tests against a real vLLM share: the Python that has vLLM (or a skip saying why), a free
loopback port, a Prometheus scrape as {(sample name, labels without model_name): value}, the tiny model
(built once per test session), and a server started with a module's own flags and env that is stopped,
and checked gone, afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

# no vLLM import in _serve: safe here
from engine_adapter.vllm_backend import (
    REPO,
    build_vllm_command,
    find_vllm_python,
    start_vllm,
    stop_vllm,
    wait_healthy,
)

__all__ = [
    "NO_VLLM",
    "VllmServer",
    "free_port",
    "scrape_metrics",
    "tiny_model",
    "vllm_python_or_skip",
    "vllm_server",
]

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


# ---- the tiny model and a server ------------------------------------------------------------------------


def tiny_model(tmp_path_factory: pytest.TempPathFactory, python: str) -> Path:
    """The tiny random-weight Llama, built on first use into the session's temporary folder.

    Why once: every real-vLLM module serves the same model (the build is deterministic), and a build costs
    a few seconds of the 2 cores. Built with ``python`` (vLLM's venv: transformers and tokenizers live
    there, not necessarily here), into a sibling folder renamed when complete, so a failed build is never
    taken for a model.
    """
    out = tmp_path_factory.getbasetemp() / "vllm-tiny-model"
    if out.is_dir():
        return out
    building = tmp_path_factory.mktemp("vllm-tiny-model-build") / "model"
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    subprocess.run(
        [python, "-m", "hintflow", "make-tiny-model", str(building)],
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    building.rename(out)
    return out


@dataclass
class VllmServer:
    """A running server: its HTTP address, and the command, environment and log it runs with."""

    base_url: str
    port: int
    model: Path
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes]


@contextmanager
def vllm_server(
    python: str,
    model: Path,
    workdir: Path,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    state_dir: Path | None = None,
    health_timeout_s: float = 150.0,
    **build_kw: Any,
) -> Iterator[VllmServer]:
    """Start vLLM's OpenAI server on a free port and yield it once ``/health`` answers; stop it at the end
    and fail if any process it started is still alive then.

    The command is :func:`build_vllm_command`'s (our scheduler, priority policy, ``PYTHONPATH``, caches
    and sockets under ``state_dir``, default a short temporary folder removed afterwards) with ``build_kw`` (``hint_port``,
    ``metrics_port``, ``pin_budget``, ``infer_hints``, ...), ``extra_args`` passed on to vLLM, and ``env``
    added to its environment. The server runs in ``workdir`` and logs to ``workdir/server.log``.
    """
    port = free_port()
    own_state = state_dir is None
    if state_dir is None:  # vLLM's IPC socket paths must stay under 107 bytes: not under pytest's tree
        state_dir = Path(tempfile.mkdtemp(prefix="hfv-"))
    argv, full_env = build_vllm_command(
        model, port=port, python=python, state_dir=state_dir, extra_args=extra_args, **build_kw
    )
    full_env.update(env or {})
    log_path = workdir / "server.log"
    proc = start_vllm(argv, full_env, log_path, cwd=workdir)
    server = VllmServer(f"http://127.0.0.1:{port}", port, model, argv, full_env, log_path, proc)
    ok = False
    try:
        wait_healthy(proc, server.base_url, log_path, timeout_s=health_timeout_s)
        yield server
        ok = True
    finally:
        # Snapshot before stopping: once the API server is gone, its engine core is no longer its child.
        tree = _process_tree(proc.pid)
        stop_vllm(proc)
        left = _wait_gone(tree, timeout_s=30.0)
        if left:
            for pid, _ in left:  # ours: started under this server, same start time as when listed
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            msg = f"vLLM left {len(left)} process(es) behind after stopping (killed): {[p for p, _ in left]}"
            if ok:
                raise RuntimeError(msg)
            print(msg, file=sys.stderr)  # the body's own error is the one to report
        if own_state:
            shutil.rmtree(state_dir, ignore_errors=True)


# ---- processes, through Linux's /proc (elsewhere the check is skipped) ---------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _process_tree(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of ``root`` and every live process below it."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        st = _stat(int(entry.name))
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append((int(entry.name), st[2]))
    root_st = _stat(root)
    tree = [(root, root_st[2])] if root_st is not None else []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            tree.append(child)
            todo.append(child[0])
    return tree


def _wait_gone(tree: Sequence[tuple[int, int]], timeout_s: float) -> list[tuple[int, int]]:
    """Those of ``tree`` still alive after ``timeout_s`` (a zombie, or a new process on a reused pid,
    counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid, start in tree:
            st = _stat(pid)
            if st is not None and st[0] != "Z" and st[2] == start:
                left.append((pid, start))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
