"""What the tests against a real vLLM share: the Python that has vLLM (or a skip saying why), a free
loopback port, a Prometheus scrape as {(sample name, labels without model_name): value}, the tiny model
(built once per test session), a server started with a module's own flags and env that is stopped, and
checked gone, afterwards, and the session's servers (:func:`want_server`, :func:`session_server`),
started side by side.

Why side by side: a tiny vLLM server spends its 40-50 s start importing vLLM on one core, idles at about
2% of a core and holds about 1.9 GB, so on the 2-core CI machine starting the session's four servers
together costs about half of starting them one after another."""

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
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
    "ServerSpec",
    "VllmServer",
    "free_port",
    "scrape_metrics",
    "session_server",
    "tiny_model",
    "vllm_python_or_skip",
    "vllm_server",
    "want_server",
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


def _launch(
    python: str,
    model: Path,
    workdir: Path,
    extra_args: Sequence[str],
    env: Mapping[str, str] | None,
    state_dir: Path | None,
    build_kw: Mapping[str, Any],
) -> tuple[VllmServer, Path | None]:
    """Start a server (not waiting for it); and the state folder to remove once it stops, if its own."""
    port = free_port()
    own_state = None
    if state_dir is None:  # vLLM's IPC socket paths must stay under 107 bytes: not under pytest's tree
        state_dir = own_state = Path(tempfile.mkdtemp(prefix="hfv-"))
    argv, full_env = build_vllm_command(
        model, port=port, python=python, state_dir=state_dir, extra_args=extra_args, **build_kw
    )
    full_env.update(env or {})
    log_path = workdir / "server.log"
    proc = start_vllm(argv, full_env, log_path, cwd=workdir)
    return VllmServer(f"http://127.0.0.1:{port}", port, model, argv, full_env, log_path, proc), own_state


def _shut(server: VllmServer, own_state: Path | None, ok: bool) -> None:
    """Stop the server and check every process it started is gone: ``RuntimeError`` if one was left
    (killed) and ``ok``; otherwise (a failure is already being reported) the leftover is only printed."""
    # Snapshot before stopping: once the API server is gone, its engine core is no longer its child.
    tree = _process_tree(server.proc.pid)
    stop_vllm(server.proc)
    left = _wait_gone(tree, timeout_s=30.0)
    if own_state is not None:
        shutil.rmtree(own_state, ignore_errors=True)
    if left:
        for pid, _ in left:  # ours: started under this server, same start time as when listed
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        msg = f"vLLM left {len(left)} process(es) behind after stopping (killed): {[p for p, _ in left]}"
        if ok:
            raise RuntimeError(msg)
        print(msg, file=sys.stderr)


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
    server, own_state = _launch(python, model, workdir, extra_args, env, state_dir, build_kw)
    ok = False
    try:
        wait_healthy(server.proc, server.base_url, server.log_path, timeout_s=health_timeout_s)
        yield server
        ok = True
    finally:
        _shut(server, own_state, ok)  # on a failure the body's own error is the one to report


# ---- the session's servers, started side by side ---------------------------------------------------------


@dataclass
class ServerSpec:
    """One session server: vLLM flags, environment, :func:`build_vllm_command` keywords (its ``*_port``
    values are picked again at launch: a test reads them from the spec once the server is up), and
    ``prepare``, run just before the server starts (what must be listening first, such as a KV-event
    subscriber; it may keep it in ``made``), returning what undoes it."""

    name: str
    flags: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    build_kw: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[ServerSpec], Callable[[], None]] | None = None
    made: dict[str, Any] = field(default_factory=dict)


_WANTED: dict[str, ServerSpec] = {}
_STARTED: dict[str, VllmServer | BaseException] = {}


def want_server(spec: ServerSpec) -> ServerSpec:
    """Register a session server when a test module is imported (pytest imports every module before it
    runs a test, so the first :func:`session_server` call knows them all). A name registered twice (a
    module imported under two names) keeps its first spec, which is returned: use the returned one."""
    return _WANTED.setdefault(spec.name, spec)


def session_server(name: str, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> VllmServer:
    """The session's server ``name``. The first call starts every registered server not started yet,
    side by side, and waits for each; each is stopped (and checked gone) when pytest ends. A server that
    did not start raises its error here, for the tests that use it only."""
    if name not in _WANTED:
        raise KeyError(f"no session server {name!r} was registered (want_server at the module's import)")
    if name not in _STARTED:
        _start_wanted(tmp_path_factory, config)
    got = _STARTED[name]
    if isinstance(got, BaseException):
        raise RuntimeError(f"the session's vLLM server {name!r} did not start") from got
    return got


def _start_wanted(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> None:
    python = vllm_python_or_skip()
    model = tiny_model(tmp_path_factory, python)
    launched: list[tuple[str, VllmServer]] = []
    for name, spec in _WANTED.items():
        if name in _STARTED:
            continue
        got = _launch_spec(spec, python, model, tmp_path_factory, config, prepare=True)
        if isinstance(got, BaseException):
            _STARTED[name] = got
        else:
            launched.append((name, got))
    # each start imports vLLM on one core: several at once take about their sum over the cores
    timeout_s = 150.0 * max(1.0, len(launched) / max(1, os.cpu_count() or 1))
    for name, server in launched:
        try:
            wait_healthy(server.proc, server.base_url, server.log_path, timeout_s=timeout_s)
            _STARTED[name] = server
        except RuntimeError as e:  # it exited while starting: once more, alone, on ports picked now
            print(f"vLLM session server {name!r} exited while starting; once more:\n{e}", file=sys.stderr)
            _STARTED[name] = _retry(_WANTED[name], python, model, tmp_path_factory, config)
        except Exception as e:
            _STARTED[name] = e


def _launch_spec(
    spec: ServerSpec,
    python: str,
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    config: pytest.Config,
    *,
    prepare: bool,
) -> VllmServer | BaseException:
    """Launch ``spec``'s server (not waiting for it), stopped when pytest ends; its error if it could not.

    Its ``*_port`` keywords are picked here, just before the launch, not when the spec was made: a port
    found free at import time can be some connection's by the time the server binds it, minutes of tests
    later, and the engine core then dies at start."""
    stack = ExitStack()  # closed when pytest ends, last in first out: the server, then what prepare made
    config.add_cleanup(stack.close)
    try:
        if prepare and spec.prepare is not None:
            stack.callback(spec.prepare(spec))
        for key in [k for k in spec.build_kw if k.endswith("_port")]:
            spec.build_kw[key] = free_port()
        workdir = tmp_path_factory.mktemp(f"vllm-{spec.name}")
        server, own_state = _launch(python, model, workdir, spec.flags, spec.env, None, spec.build_kw)
    except Exception as e:
        return e
    stack.callback(_shut, server, own_state, True)
    return server


def _retry(
    spec: ServerSpec, python: str, model: Path, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config
) -> VllmServer | BaseException:
    # what prepare made (a bound subscriber) is still there: the new server uses it
    got = _launch_spec(spec, python, model, tmp_path_factory, config, prepare=False)
    if isinstance(got, BaseException):
        return got
    try:
        wait_healthy(got.proc, got.base_url, got.log_path, timeout_s=150.0)
    except Exception as e:
        return e
    return got


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
