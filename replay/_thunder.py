"""ThunderAgent's pause/restore controller in the replay: the shell that carries out
``orchestrator.ThunderAgent``'s plan (the rule itself, and its description, live there).

Every ``period_s`` of virtual time the controller weighs each node's sessions (a turn queued or running:
its prompt; in a tool: its context, halved per second in the tool) and pauses, restores and un-pauses.
Here a pause drops the context's device KV at once (``KVCacheManager._drop_device``, the call the engine
makes for a finished vLLM-style turn: the replay has no engine-level pause; the live shells push
``thunder_pause_hints`` instead), a restore starts the held turn on the node the controller chose (any
replica: the global queue is what lets a program move; the router follows the session there, so its next
turns go where its context now is), and new programs are admitted at once, as vLLM
would; only paused sessions go through the global queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_adapter import SessionState
from hints import Pin
from orchestrator import THUNDER_PERIOD_S, SessionLoad, ThunderAgent

if TYPE_CHECKING:
    from replay._runs import ProgramRun, SessionRun
    from replay._sim import Simulation

__all__ = ["ThunderController"]


class ThunderController:
    """Holds paused sessions' turns in the controller's global queue; ``control`` runs every ``period_s``."""

    def __init__(self, sim: Simulation, period_s: float = THUNDER_PERIOD_S) -> None:
        self.sim = sim
        self.agent = ThunderAgent(period_s)
        self.period_s = period_s
        self._held: dict[str, SessionRun] = {}  # the held turns' sessions, by key

    @property
    def num_pauses(self) -> int:
        return self.agent.num_pauses

    @property
    def num_restores(self) -> int:
        return self.agent.num_restores

    def hold(self, s: SessionRun) -> bool:
        """A turn is ready: True when the session is paused, so the turn waits for a restore."""
        if not self.agent.hold(s.key, len(s.context)):
            return False
        self._held[s.key] = s
        return True

    def tool_started(self, s: SessionRun) -> None:
        """Nothing to do at once: ThunderAgent decides only on its period."""

    def program_ended(self, run: ProgramRun) -> None:
        for s in run.sessions.values():
            self.agent.forget(s.key)

    def _loads(self) -> list[SessionLoad]:
        """The live sessions ThunderAgent weighs: a turn queued or running, or in a tool."""
        now, out = self.sim.now, []
        for s in self.sim.live.values():
            if s.request is not None:
                out.append(SessionLoad(s.key, s.node, len(s.prompt)))
            elif (p := self.sim.core.pauses.get(s.key)) is not None and p.returned_s is None:
                out.append(SessionLoad(s.key, s.node, len(s.context), now - p.started_s))
        return out

    def control(self) -> None:
        sim = self.sim
        capacity = {n.address: n.engine.kv.device.num_blocks * n.block_size for n in sim.nodes}
        idle = [n.address for n in sim.nodes if not n.engine.scheduler.has_work() and not n.busy]
        plan = self.agent.control(self._loads(), capacity, idle)
        for address, key in plan.pause:
            kv = sim.by_address[address].engine.kv
            es = kv.sessions.get(key)
            if es is not None and es.state is SessionState.PARKED:
                sim.by_address[address].engine.apply_hints([Pin(session_id=key, ttl_s=0.0)])
                kv._drop_device(es, len(es.block_ids))
        for key, address in plan.restore:
            sim.start_turn(self._held.pop(key), sim.by_address[address])
        if any(r.end_s is None for r in sim.runs):
            sim.at(sim.now + self.period_s, self.control)
