"""The child processes of ``hintflow soak``: starting, killing and stopping them, and what the workers count.

The children are engine nodes and workers, each a ``python -m hintflow`` subprocess on loopback.

A node keeps its address across lives (it is started again on the port its first life got), so the workers'
routers see the same node come back with a new epoch.  A worker comes back as a fresh process.  Every child
writes stdout and stderr to a log file of its own per life (``node-0.2.log``: node-0's second life).

Every child is started through a small exec wrapper that asks the kernel to SIGKILL it if the soak process
dies (``PR_SET_PDEATHSIG``).  The soak stops its children on every exit it sees (the end, Ctrl-C, SIGTERM,
an error); the wrapper covers the one it cannot see, a SIGKILL of the soak itself.

Moves done and failed are what the workers count (``hintflow_context_moves_total{outcome}``, their
``/metrics``), scraped every ``SCRAPE_EVERY_S`` and just before a worker is killed (``_soak_chaos.Chaos``),
and summed over every worker life.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "MIGRATIONS_TOTAL",
    "SCRAPE_EVERY_S",
    "START_TIMEOUT_S",
    "STOP_GRACE_S",
    "Fleet",
    "Member",
    "MigrationView",
    "free_port",
    "scrape_migrations",
    "watch_workers",
]

# A child whose parent (this soak process) dies is SIGKILLed by the kernel.  The parent's pid comes as the
# first argument: if it is no longer our parent, the soak died before the prctl took hold.
_EXEC_WITH_PARENT_DEATH = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
_NODE_READY = re.compile(r"hintflow engine node \S+ serving on (\S+) ")
_WORKER_READY = "hintflow worker: task queue"
START_TIMEOUT_S = 180.0
"""How long a child may take to serve: a torch node or a worker imports for ~5 s on an idle 2-core machine,
several times that when the machine is loaded by the run it joins."""
STOP_GRACE_S = 10.0
"""SIGTERM to SIGKILL at the end: a worker drains and flushes its hints (2 s), a node stops with 2 s grace."""
_START_ATTEMPTS = 4  # a port taken between choosing it and binding it: try again, then give up

MIGRATIONS_TOTAL = "hintflow_context_moves_total"
"""The workers' counter of context moves (``workflows/_context_moves.py``), label ``outcome``: done, failed,
skipped (recomputing was expected to be quicker)."""
SCRAPE_EVERY_S = 2.0  # the workers' migration counters, kept per life (a SIGKILL takes the rest with it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class MigrationView:
    """What workers' ``/metrics`` say about context moves; ``reported`` False: no such series is served."""

    reported: bool = False
    num_done: int = 0
    num_failed: int = 0
    num_skipped: int = 0


def scrape_migrations(port: int, timeout_s: float = 2.0) -> MigrationView | None:
    """The worker's move counts, or None if its ``/metrics`` does not answer (dead, or starting)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return None
    view = MigrationView()
    for family in text_string_to_metric_families(text):
        # (a labelled counter no move has touched yet shows as a family with no samples)
        if family.name == MIGRATIONS_TOTAL.removesuffix("_total"):
            view.reported = True
        for sample in family.samples:
            if sample.name == MIGRATIONS_TOTAL:
                outcome = sample.labels.get("outcome")
                if outcome in ("done", "failed", "skipped"):
                    setattr(view, f"num_{outcome}", getattr(view, f"num_{outcome}") + int(sample.value))
    return view


@dataclass
class Member:
    """One node or worker slot: the process of its current life, and what its earlier lives left."""

    kind: str  # "node" | "worker"
    name: str  # node-0, worker-1
    args: list[str]  # `hintflow` arguments; a node's --port and a worker's --metrics-port are added per life
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    num_lives: int = 0
    address: str = ""  # a node's HOST:PORT, fixed by its first life
    metrics_port: int = 0  # a worker's /metrics, new each life
    ready: bool = False
    # a worker's migration counts: the last scrape of each life (a killed life's counters die with it)
    migrations_by_life: dict[int, MigrationView] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Fleet:
    """Starts, kills and stops the soak's children; every process it started is in ``members``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.members: list[Member] = []
        self.pids: list[int] = []  # every child process ever started, for the record

    def of_kind(self, kind: str) -> list[Member]:
        return [m for m in self.members if m.kind == kind]

    def ready(self, kind: str) -> list[Member]:
        return [m for m in self.of_kind(kind) if m.ready and m.alive]

    def _spawn(self, m: Member, extra: list[str]) -> None:
        m.num_lives += 1
        m.ready = False
        m.log = self.log_dir / f"{m.name}.{m.num_lives}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if m.kind == "node":  # several nodes share few cores: one torch thread each, not several each
            env["OMP_NUM_THREADS"] = "1"
        with m.log.open("wb") as out:
            # (from the event loop's thread: PR_SET_PDEATHSIG fires when the thread that forked ends)
            m.proc = subprocess.Popen(
                [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH, str(os.getpid()), "-m", "hintflow", *m.args,
                 *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )  # fmt: skip
        self.pids.append(m.proc.pid)

    async def _wait_ready(self, m: Member, timeout_s: float) -> bool:
        """Until the child says it serves (True) or exits first (False); a timeout is an error."""
        assert m.proc is not None and m.log is not None
        deadline = time.monotonic() + timeout_s
        while True:
            text = m.log.read_text(errors="replace")
            if m.kind == "node":
                found = _NODE_READY.search(text)
                if found:
                    m.address = found.group(1)
                    m.ready = True
                    return True
            elif _WORKER_READY in text:
                m.ready = True
                return True
            if m.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.kill(m)
                raise RuntimeError(f"{m.name} did not serve within {timeout_s:.0f} s:\n{self.tail(m)}")
            await asyncio.sleep(0.1)

    async def start(self, m: Member, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start ``m``'s next life and wait until it serves; a node on its first life's port."""
        if m not in self.members:
            self.members.append(m)
        for _ in range(_START_ATTEMPTS):
            if m.kind == "node":
                extra = ["--port", m.address.rsplit(":", 1)[1] if m.address else "0"]
            else:
                m.metrics_port = free_port()
                extra = ["--metrics-port", str(m.metrics_port)]
            self._spawn(m, extra)
            if await self._wait_ready(m, timeout_s):
                return
            await asyncio.sleep(1.0)  # a port in use (another process took it, or it is not yet let go)
        raise RuntimeError(f"{m.name} exited before serving, {_START_ATTEMPTS} times:\n{self.tail(m)}")

    def kill(self, m: Member) -> None:
        """SIGKILL, and reap it."""
        m.ready = False
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait()

    async def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child still running, SIGKILL any left after ``grace_s``; all reaped."""
        running = [m.proc for m in self.members if m.proc is not None and m.proc.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for p in running:
            if p.poll() is None:
                p.kill()
            p.wait()
        for m in self.members:
            m.ready = False

    def tail(self, m: Member, num_chars: int = 3000) -> str:
        if m.log is None or not m.log.exists():
            return "(no log)"
        return m.log.read_text(errors="replace")[-num_chars:]

    # ---- what the workers report ---------------------------------------------------------------------
    async def scrape_worker(self, m: Member) -> MigrationView | None:
        if m.kind != "worker" or not m.ready:
            return None
        view = await asyncio.to_thread(scrape_migrations, m.metrics_port)
        if view is not None:
            m.migrations_by_life[m.num_lives] = view
        return view

    def migrations(self) -> MigrationView:
        """Moves over every worker life (each life's last scrape)."""
        total = MigrationView()
        for m in self.of_kind("worker"):
            for view in m.migrations_by_life.values():
                total.reported |= view.reported
                total.num_done += view.num_done
                total.num_failed += view.num_failed
                total.num_skipped += view.num_skipped
        return total


async def watch_workers(fleet: Fleet) -> None:
    """Scrape every serving worker's migration counters now and then, until cancelled."""
    while True:
        await asyncio.gather(*(fleet.scrape_worker(w) for w in fleet.ready("worker")))
        await asyncio.sleep(SCRAPE_EVERY_S)
