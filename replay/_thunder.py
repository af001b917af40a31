"""ThunderAgent's pause/restore controller (arXiv 2602.13692), run by the replay over the nodes' state.

Every ``period_s`` (Δt = 5 s), for each node::

    load = Σ_reasoning c  +  Σ_acting c · 2^(−t_tool)        (c: context tokens, t_tool: seconds in the tool)

and when ``load`` exceeds the node's device KV capacity the node thrashes: acting sessions (in a tool) are
paused, shortest context first (a paused context is recomputed later, at a cost growing like c², so the
short ones are the cheap ones to give up), until the load fits.  Pausing drops the context's device KV;
when its tool returns, the session's next turn waits in one global queue instead of being submitted.  At
each period the queue is restored, reasoning (ready) sessions first, shortest first, onto whichever node has
room (any replica: the global queue is what lets a program move).  Paused sessions still in their tool are
un-paused after that when room remains.

Approximations (the paper runs in front of vLLM; the replay has no engine-level pause):
* dropping a context uses ``KVCacheManager._drop_device``, the same call the engine uses for a finished
  vLLM-style turn; a public pause hint would be cleaner (see the report);
* the unit paused is a session (one KV context); for single-session workloads that is the program;
* new programs are admitted at once, as vLLM would; only paused sessions go through the global queue;
* if nothing fits anywhere but some node is completely idle, the queue head goes there, so a context
  larger than a node's capacity cannot wait forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_adapter import SessionState
from hints import Pin

if TYPE_CHECKING:
    from replay._nodes import SimNode
    from replay._runs import ProgramRun, SessionRun
    from replay._sim import Simulation

__all__ = ["ThunderController"]


class ThunderController:
    """Holds paused sessions' turns in a global queue; ``control`` runs every ``period_s`` of virtual time."""

    def __init__(self, sim: Simulation, period_s: float = 5.0) -> None:
        self.sim = sim
        self.period_s = period_s
        self.paused: set[str] = set()
        self.queue: list[SessionRun] = []
        self.num_pauses = 0
        self.num_restores = 0

    def hold(self, s: SessionRun) -> bool:
        """A turn is ready: True when the session is paused, so the turn waits for a restore."""
        if s.key not in self.paused:
            return False
        self.queue.append(s)
        return True

    def tool_started(self, s: SessionRun) -> None:
        """Nothing to do at once: ThunderAgent decides only on its period."""

    def program_ended(self, run: ProgramRun) -> None:
        for s in run.sessions.values():
            self.paused.discard(s.key)

    def _weights(self, node: SimNode) -> tuple[float, list[tuple[int, float, SessionRun]]]:
        """(load, acting sessions as (context, weight, session)) of one node's unpaused sessions."""
        now = self.sim.now
        load = 0.0
        acting = []
        for s in self.sim.live.values():
            if s.node != node.address or s.key in self.paused:
                continue
            if s.request is not None:
                load += len(s.prompt)
            elif (p := self.sim.core.pauses.get(s.key)) is not None and p.returned_s is None:
                w = len(s.context) * 2.0 ** (-(now - p.started_s))
                load += w
                acting.append((len(s.context), w, s))
        return load, acting

    def _pause(self, node: SimNode, s: SessionRun) -> None:
        kv = node.engine.kv
        es = kv.sessions.get(s.key)
        if es is not None and es.state is SessionState.PARKED:
            node.engine.apply_hints([Pin(session_id=s.key, ttl_s=0.0)])
            kv._drop_device(es, len(es.block_ids))
        self.paused.add(s.key)
        self.num_pauses += 1

    def control(self) -> None:
        sim = self.sim
        loads: dict[str, float] = {}
        for node in sim.nodes:
            capacity = node.engine.kv.device.num_blocks * node.block_size
            load, acting = self._weights(node)
            for _c, w, s in sorted(acting, key=lambda x: (x[0], x[2].key)):
                if load <= capacity:
                    break
                self._pause(node, s)
                load -= w
            loads[node.address] = load
        self._restore(loads)
        if any(r.end_s is None for r in sim.runs):
            sim.at(sim.now + self.period_s, self.control)

    def _restore(self, loads: dict[str, float]) -> None:
        sim = self.sim
        capacity = {n.address: n.engine.kv.device.num_blocks * n.block_size for n in sim.nodes}

        def room(c: int) -> str | None:
            fits = [a for a in loads if loads[a] + c <= capacity[a]]
            if not fits:
                idle = [n.address for n in sim.nodes if not n.engine.scheduler.has_work() and not n.busy]
                fits = idle[:1]
            return min(fits, key=lambda a: (loads[a], a)) if fits else None

        waiting = sorted(self.queue, key=lambda s: (len(s.context), s.key))
        self.queue = []
        for i, s in enumerate(waiting):
            c = len(s.context)
            address = room(c)
            if address is None:
                self.queue = waiting[i:]
                break
            loads[address] += c
            self.paused.discard(s.key)
            self.num_restores += 1
            sim.start_turn(s, sim.by_address[address])
        if self.queue:
            return
        acting = sorted((s for s in sim.live.values() if s.key in self.paused), key=lambda s: len(s.context))
        for s in acting:
            address = room(len(s.context))
            if address is None:
                return
            loads[address] += len(s.context)
            self.paused.discard(s.key)
