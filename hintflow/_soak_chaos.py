"""The chaos loop of ``hintflow soak``: it SIGKILLs nodes and workers of the fleet (``_soak_fleet.Fleet``)
and starts them again.

The chaos loop fires at seeded random intervals (uniform in 0.5-1.5 times the mean).  Its events come from a
shuffled deck of three, dealt again when empty, so every kind comes up once in any three events whatever the
seed: kill a node, kill a worker, cut a migration.  A cut watches the nodes for up to one mean interval
(``CUT_WAIT_S`` at most) and
kills the first one that is moving a context out or in (a move leases its session on both ends: RUNNING with
no turn, see ``engine_adapter/_context_export.py``); when none is, a node is killed all the same and the cut
is counted as not found.  A victim is chosen among the serving members of its kind and started again after
a random 0.5-3 s down; the last serving member of its kind comes back at once, so the soak is never without a
node or a worker for longer than a start.  A worker's move counters are scraped just before it is killed:
its counters die with it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from hintflow._soak_fleet import Fleet, Member

__all__ = ["CUT_WAIT_S", "Chaos", "ChaosCounts"]

CUT_WAIT_S = 10.0
"""The longest a cut watches the nodes for a context on the move before it kills a node anyway (it waits
one mean interval when that is shorter, so that a cut does not hold up the next events)."""
_CUT_POLL_S = 0.05  # a move of a small context takes tens of milliseconds: look often while a cut waits


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
