"""The child processes of ``hintflow soak`` and the chaos loop that kills them.

The children are engine nodes and workers, each a ``python -m hintflow`` subprocess on loopback.

A node keeps its address across lives (it is started again on the port its first life got), so the workers'
routers see the same node come back with a new epoch.  A worker comes back as a fresh process.  Every child
writes stdout and stderr to a log file of its own per life (``node-0.2.log``: node-0's second life).

Every child is started through a small exec wrapper that asks the kernel to SIGKILL it if the soak process
dies (``PR_SET_PDEATHSIG``).  The soak stops its children on every exit it sees (the end, Ctrl-C, SIGTERM,
an error); the wrapper covers the one it cannot see, a SIGKILL of the soak itself.

The chaos loop fires at seeded random intervals (uniform in 0.5-1.5 times the mean).  Its events come from a
shuffled deck of three, dealt again when empty, so every kind comes up once in any three events whatever the
seed: kill a node, kill a worker, cut a migration.  A cut watches the nodes for up to one mean interval
(``CUT_WAIT_S`` at most) and
kills the first one that is moving a context out or in (a move leases its session on both ends: RUNNING with
no turn, see ``engine_adapter/_context_export.py``); when none is, a node is killed all the same and the cut
is counted as not found.  A victim is chosen among the serving members of its kind and started again after
a random 0.5-3 s down; the last serving member of its kind comes back at once, so the soak is never without a
node or a worker for longer than a start.

Moves done and failed are what the workers count (``hintflow_context_moves_total{outcome}``, their
``/metrics``), scraped every ``SCRAPE_EVERY_S`` and just before a worker is killed, and summed over every
worker life.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "MIGRATIONS_TOTAL",
    "Chaos",
    "ChaosCounts",
    "Fleet",
    "Member",
    "MigrationView",
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


# ---- the chaos loop ----------------------------------------------------------------------------------
CUT_WAIT_S = 10.0
"""The longest a cut watches the nodes for a context on the move before it kills a node anyway (it waits
one mean interval when that is shorter, so that a cut does not hold up the next events)."""
_CUT_POLL_S = 0.05  # a move of a small context takes tens of milliseconds: look often while a cut waits
SCRAPE_EVERY_S = 2.0  # the workers' migration counters, kept per life (a SIGKILL takes the rest with it)


@dataclass
class ChaosCounts:
    num_node_kills: int = 0  # every node SIGKILLed, cuts included
    num_node_restarts: int = 0
    num_worker_kills: int = 0
    num_worker_restarts: int = 0
    num_migration_cuts: int = 0  # nodes killed while a worker reported a move to or from them
    num_cuts_not_found: int = 0  # cut events that saw no move in flight (a node was killed instead)
    num_restart_failures: int = 0


class Chaos:
    """Kills and restarts members of ``fleet`` at random seeded times until told to stop."""

    def __init__(
        self, fleet: Fleet, rng: random.Random, interval_s: float, emit: Callable[[str], None], t0: float
    ) -> None:
        self.fleet = fleet
        self.rng = rng
        self.interval_s = interval_s
        self.emit = emit
        self.t0 = t0
        self.counts = ChaosCounts()
        self._restarts: set[asyncio.Task[None]] = set()
        self._deck: list[str] = []

    def _say(self, text: str) -> None:
        self.emit(f"{time.monotonic() - self.t0:8.1f} s  {text}")

    async def run(self, until_s: float) -> None:
        """Events until the monotonic time ``until_s``."""
        if self.interval_s <= 0:
            return
        while True:
            at = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.interval_s
            if at >= until_s:
                return
            await asyncio.sleep(at - time.monotonic())
            if not self._deck:
                self._deck = ["node", "worker", "cut"]
                self.rng.shuffle(self._deck)
            kind = self._deck.pop()
            if kind == "cut":
                await self._cut()
            else:
                await self._kill(kind, None, "")

    async def settle(self) -> None:
        """Wait for every restart under way (each bounded by ``START_TIMEOUT_S``)."""
        while self._restarts:
            await asyncio.gather(*self._restarts, return_exceptions=True)

    async def cancel(self) -> None:
        for t in list(self._restarts):
            t.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)

    async def _kill(self, kind: str, victim: Member | None, why: str) -> None:
        serving = self.fleet.ready(kind)
        if victim is None:
            if not serving:
                self._say(f"kill a {kind}: none serving now (all restarting); skipped")
                return
            victim = self.rng.choice(serving)
        if kind == "worker":
            await self.fleet.scrape_worker(victim)  # what it counted, before its counters die with it
        pid, life = victim.pid, victim.num_lives
        self.fleet.kill(victim)
        if kind == "node":
            self.counts.num_node_kills += 1
        else:
            self.counts.num_worker_kills += 1
        # The last one serving comes back at once: never without a node or a worker for long.
        down_s = self.rng.uniform(0.5, 3.0) if len(serving) > 1 else 0.0
        self._say(f"SIGKILL {victim.name} (pid {pid}, life {life}){why}; back in {down_s:.1f} s")
        task = asyncio.create_task(self._restart(victim, down_s))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, m: Member, down_s: float) -> None:
        await asyncio.sleep(down_s)
        t = time.monotonic()
        try:
            await self.fleet.start(m)
        except RuntimeError as exc:
            self.counts.num_restart_failures += 1
            self._say(f"{m.name} did not come back: {exc}")
            return
        if m.kind == "node":
            self.counts.num_node_restarts += 1
        else:
            self.counts.num_worker_restarts += 1
        where = f" on {m.address}" if m.kind == "node" else ""
        self._say(
            f"{m.name} life {m.num_lives} serving{where} (pid {m.pid}, started in {time.monotonic() - t:.1f} s)"
        )

    async def _cut(self) -> None:
        """Kill a node that is moving a context out or in; a node all the same if none is within the wait."""
        wait_s = min(CUT_WAIT_S, self.interval_s)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            nodes = self.fleet.ready("node")
            moving = await asyncio.gather(*(_num_moving(n.address) for n in nodes))
            busy = [n for n, k in zip(nodes, moving, strict=True) if k > 0]
            if busy:
                victim = self.rng.choice(busy)
                self.counts.num_migration_cuts += 1
                await self._kill("node", victim, " mid-migration")
                return
            await asyncio.sleep(_CUT_POLL_S)
        self.counts.num_cuts_not_found += 1
        await self._kill("node", None, f" (cut: no migration in flight within {wait_s:g} s)")


async def _num_moving(address: str) -> int:
    """Contexts the node is moving out or in now: a move leases its session, which is then RUNNING with no
    turn running on it (0 if the node does not answer)."""
    from hints import EngineClient

    try:
        async with EngineClient(address) as c:
            st = await asyncio.wait_for(c.get_cache_state(include_sessions=True), 1.0)
    except Exception:  # dead or busy: not a node to cut now
        return 0
    return sum(s.state == "running" for s in st.sessions) - st.num_running


async def watch_workers(fleet: Fleet) -> None:
    """Scrape every serving worker's migration counters now and then, until cancelled."""
    while True:
        await asyncio.gather(*(fleet.scrape_worker(w) for w in fleet.ready("worker")))
        await asyncio.sleep(SCRAPE_EVERY_S)
