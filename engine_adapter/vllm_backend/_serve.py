"""Start vLLM's OpenAI server with hintflow's scheduler and hint service (``hintflow engine serve --backend vllm``).

Why a function and not a shell line: the same command serves users, tests and the agent benchmark, and it
must get several things right every time. ``vllm serve`` fails in the CPU build (no ``vllm`` distribution
metadata), so the module entry point is used; ``engine_adapter`` must be importable in vLLM's engine-core
process (``PYTHONPATH`` gets the repository root); vLLM writes caches, sockets and temporary files outside
the work tree unless ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``VLLM_RPC_BASE_PATH`` and
``TMPDIR`` point into ``state_dir``; ``--gpu-memory-utilization`` is a fraction of the NUMA node's memory on
CPU, whose default (0.92) fails beside other processes, so 0.1 unless given. Flags in ``extra_args`` pass
through to vLLM unchanged and win over these defaults.

The scheduler class follows async scheduling (:func:`scheduler_cls_for`): vLLM uses a ``--scheduler-cls``
as given whatever ``async_scheduling`` says, so the class must match the mode (``_scheduler``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ._compat import check_vllm_python
from ._host_index import host_tier_config

__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "AUTO_SCHEDULER_CLS",
    "NODE_SETTINGS",
    "SCHEDULER_CLS",
    "TRACED_STOCK_SCHEDULER_CLS",
    "async_scheduling_flag",
    "build_vllm_command",
    "find_vllm_python",
    "log_excerpt",
    "scheduler_cls_for",
    "serve_vllm",
    "start_vllm",
    "stop_vllm",
    "supervise",
    "wait_healthy",
]

SCHEDULER_CLS = "engine_adapter.vllm_backend._scheduler.HintflowScheduler"
ASYNC_SCHEDULER_CLS = "engine_adapter.vllm_backend._scheduler.HintflowAsyncScheduler"
AUTO_SCHEDULER_CLS = "engine_adapter.vllm_backend._scheduler.HintflowAutoScheduler"
TRACED_STOCK_SCHEDULER_CLS = "engine_adapter.vllm_backend._scheduler.TracedAutoScheduler"
REPO = Path(__file__).resolve().parents[2]
NODE_SETTINGS = (
    "HINTFLOW_ADMIT_FRACTION", "HINTFLOW_ADMIT_GUARD", "HINTFLOW_ADMIT_HORIZON_S", "HINTFLOW_ADMIT_MAX_WAIT_S",
    "HINTFLOW_FCFS_SLACK",
    "HINTFLOW_HINT_HOST", "HINTFLOW_HINT_PORT", "HINTFLOW_HOLD_QUEUED", "HINTFLOW_HOST_RELOAD_S_PER_TOKEN",
    "HINTFLOW_HOST_SAVE",
    "HINTFLOW_INFER_DEFER_S", "HINTFLOW_INFER_HINTS", "HINTFLOW_INFER_MEASURED_PRICE", "HINTFLOW_INFER_MEMORY_SHARE",
    "HINTFLOW_INFER_RELOAD_S_PER_TOKEN", "HINTFLOW_INFER_RENEW", "HINTFLOW_INFER_SILENT_S", "HINTFLOW_METRICS_HOST", "HINTFLOW_METRICS_PORT",
    "HINTFLOW_NODE_ID", "HINTFLOW_PINNED_FIRST", "HINTFLOW_PIN_BUDGET", "HINTFLOW_PIN_GRACE_S",
    "HINTFLOW_PRIORITY_AGING_S", "HINTFLOW_STEP_TRACE", "HINTFLOW_TTFT_DEADLINE_S", "HINTFLOW_WARM_FIRST",
    "HINTFLOW_WARM_THRESHOLD_TOKENS", "HINTFLOW_YIELD_PINS",
)  # fmt: skip
"""Every setting a hintflow vLLM node reads from its environment (docs/vllm-backend.md says what each does):
what a caller may set checks against this, so a misspelt name is an error, not a setting that does nothing
(tests/test_vllm_compat_unit.py keeps it equal to the names the package reads)."""


def find_vllm_python() -> str | None:
    """A Python that has vLLM installed: ``$HINTFLOW_VLLM_PYTHON``, else the repo's ``.venv-vllm``, else this one.

    vLLM lives in its own venv (it pins numpy and click versions the main environment must not get). Found,
    not imported (``importlib.util.find_spec``, ~50 ms rather than ~3.5 s for ``import vllm``): whoever runs
    it next imports it anyway (``check_vllm_python`` before a server, or the server itself), and a vLLM
    that is installed but broken fails there with its own error.
    """
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    for py in (
        os.environ.get("HINTFLOW_VLLM_PYTHON", ""),
        str(REPO / ".venv-vllm" / "bin" / "python"),
        sys.executable,
    ):
        if py and Path(py).exists():
            r = subprocess.run([py, "-c", probe], capture_output=True, timeout=120)
            if r.returncode == 0:
                return py
    return None


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def async_scheduling_flag(args: Sequence[str]) -> bool | None:
    """What vLLM flags say about async scheduling: the last ``--async-scheduling`` (True) or
    ``--no-async-scheduling`` (False), as vLLM's parser reads them (underscores allowed); None for neither."""
    said: bool | None = None
    for a in args:
        if a.startswith("--"):
            name = "--" + a[2:].split("=", 1)[0].replace("_", "-")
            if name in ("--async-scheduling", "--no-async-scheduling"):
                said = name == "--async-scheduling"
    return said


def scheduler_cls_for(args: Sequence[str]) -> str:
    """The ``--scheduler-cls`` for vLLM flags ``args``: the async class when they ask for async scheduling,
    the synchronous one when they turn it off, else the class that decides in the engine core.

    Why the last: without either flag vLLM decides (on by default; off for pooling models, some
    speculative decoding, executors without support, and always on CPU), which only its final config in
    the engine core knows for sure, and a ``--config`` file may set it where this cannot see.
    """
    said = async_scheduling_flag(args)
    return AUTO_SCHEDULER_CLS if said is None else ASYNC_SCHEDULER_CLS if said else SCHEDULER_CLS


def build_vllm_command(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    hint_port: int | None = None,
    metrics_port: int | None = None,
    pin_budget: float | None = None,
    node_id: str | None = None,
    state_dir: str | Path = ".hintflow-vllm",
    python: str | None = None,
    extra_args: Sequence[str] = (),
    hintflow: bool = True,
    infer_hints: bool | None = None,
    host_capacity_tokens: int | None = None,
    context_moves: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that serve ``model_dir``; ``hintflow=False`` gives stock vLLM (a baseline).

    ``hint_port`` None: no hint service (inferred hints still work). ``metrics_port`` (0: a free one,
    None or -1: none) serves the ``hintflow_*`` metrics from the engine-core process; they start with the
    hint service (the scheduler starts nothing else), so without a ``hint_port`` the hint service takes
    a free loopback port. ``infer_hints`` None keeps the scheduler's default (on). ``state_dir`` receives
    vLLM's caches, sockets and temporary files. ``host_capacity_tokens`` (positive) adds hintflow's host
    KV tier (``_host_connector``) through ``--kv-transfer-config``, with or without hintflow's scheduler.
    ``context_moves``: vLLM runs the model in its engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    where the hint service can export and import contexts (``_context_moves``); on one GPU vLLM does so
    already, on the CPU build it otherwise runs the model in a worker process of its own.
    """
    extra = list(extra_args)
    state = Path(state_dir).resolve()
    env = dict(os.environ)
    for var, sub in (
        ("VLLM_CACHE_ROOT", "cache"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("VLLM_RPC_BASE_PATH", "rpc"),
        ("TMPDIR", "tmp"),
    ):
        (state / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(state / sub)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if context_moves:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    argv = [
        python or find_vllm_python() or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
    ]
    argv += ["--host", host, "--port", str(port), "--enable-prompt-tokens-details"]
    if not _has_flag(extra, "--gpu-memory-utilization"):
        argv += ["--gpu-memory-utilization", "0.1"]
    if host_capacity_tokens:
        if _has_flag(extra, "--kv-transfer-config"):
            raise ValueError("a host tier and --kv-transfer-config both configure vLLM's KV connector: pass one")
        argv += ["--kv-transfer-config", json.dumps(host_tier_config(host_capacity_tokens))]
    if hintflow:
        if not _has_flag(extra, "--scheduler-cls"):
            argv += ["--scheduler-cls", scheduler_cls_for(extra)]
        if not _has_flag(extra, "--scheduling-policy"):
            argv += ["--scheduling-policy", "priority"]  # program-level FCFS needs vLLM's priority queue
        if hint_port is not None:
            env["HINTFLOW_HINT_PORT"] = str(hint_port)
        if metrics_port is not None and metrics_port >= 0:
            env["HINTFLOW_METRICS_PORT"] = str(metrics_port)
            env.setdefault("HINTFLOW_METRICS_HOST", host)
        if pin_budget is not None:
            env["HINTFLOW_PIN_BUDGET"] = str(pin_budget)
        if node_id:
            env["HINTFLOW_NODE_ID"] = node_id
        if infer_hints is not None:
            env["HINTFLOW_INFER_HINTS"] = "1" if infer_hints else "0"
    elif env.get("HINTFLOW_STEP_TRACE", "").strip() and not _has_flag(extra, "--scheduler-cls"):
        argv += ["--scheduler-cls", TRACED_STOCK_SCHEDULER_CLS]  # stock scheduling, each step traced
    return argv + extra, env


def start_vllm(
    argv: Sequence[str], env: dict[str, str], log_path: str | Path, cwd: str | Path | None = None
) -> subprocess.Popen[bytes]:
    """Start the server with stdout and stderr in ``log_path`` (the caller terminates it)."""
    log = open(log_path, "wb")  # noqa: SIM115 (the child holds it; closed here once it is inherited)
    try:
        return subprocess.Popen(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    finally:
        log.close()


def wait_healthy(
    proc: subprocess.Popen[bytes], base_url: str, log_path: str | Path, timeout_s: float = 300.0
) -> None:
    """Poll ``/health`` until it answers; the log's first error and its tail in the error if the server
    dies or never answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode}:\n{log_excerpt(Path(log_path).read_text())}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(log_excerpt(Path(log_path).read_text())) from None
            time.sleep(0.5)


_FIRST_ERROR = re.compile(r"^.*(?:Traceback \(most recent call last\)|\bERROR\b).*$", re.MULTILINE)


def log_excerpt(text: str, head_chars: int = 3000, tail_chars: int = 3000) -> str:
    """The part of a vLLM log that says why it failed: from its first traceback or ``ERROR`` line (the
    engine core's root cause, which the API server's own traceback at the end pushes out of a tail) and
    the tail, or the tail alone when the first error is in it."""
    tail_at = max(0, len(text) - tail_chars)
    first = _FIRST_ERROR.search(text)
    if first is None or first.start() >= tail_at:
        return text[tail_at:]
    head = text[first.start() : min(first.start() + head_chars, tail_at)]
    skipped = tail_at - first.start() - len(head)
    return head + (f"\n[... {skipped} characters ...]\n" if skipped else "") + text[tail_at:]


def stop_vllm(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_vllm(model_dir: str | Path, **kw: object) -> int:
    """Run the server in the foreground until it exits (Ctrl-C stops it); its exit status.

    Keyword arguments are :func:`build_vllm_command`'s. Output goes to this process's stdout/stderr.
    With hintflow's scheduler, the vLLM it runs on is checked first (``_compat.check_vllm_python``, about
    7 s against the server's 30-60 s start): a vLLM that lacks an internal the scheduler relies on raises
    ``RuntimeError`` naming it here, rather than deep in the engine core's start-up log.
    """
    argv, env = build_vllm_command(model_dir, **kw)  # type: ignore[arg-type]
    if kw.get("hintflow", True):
        check_vllm_python(argv[0], env)
    return supervise(subprocess.Popen(argv, env=env))


class _Terminated(Exception):
    """SIGTERM arrived (raised by ``supervise``'s handler, so the ``finally`` paths run as on Ctrl-C)."""


def supervise(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the server; on Ctrl-C or SIGTERM stop it first (terminate, then kill after 30 s).

    Why SIGTERM too: its default action ends this process at once and leaves the vLLM server it started
    running, still bound to the port (the next server there failed to bind, and a health check reached the
    orphan). The exit status is the server's, else 130 (Ctrl-C) or 143 (SIGTERM), as a shell reports them.
    """

    def on_term(signum: int, frame: object) -> None:
        raise _Terminated

    previous = None
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        stop_vllm(proc)
        return 130
    except _Terminated:
        stop_vllm(proc)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
