"""ThunderAgent's pause/restore controller on the live runtime: the shell that carries out
``orchestrator.ThunderAgent``'s plan on real nodes (the rule itself lives there, shared with the replay and
the real-vLLM harness).

Every ``period_s`` it weighs each node's sessions (a model call in flight: its prompt; a session in its
tool: its context, halved per second in the tool) against the node's device pool from its cache state,
and carries out the plan:

* **pause**: the node is told to let the context go first (``thunder_pause_hints``: unpinned, ranked
  first to evict; a node has no pause of its own), and the session's next model call waits in
  :meth:`LiveThunder.admit` instead of being routed;
* **restore**: a waiting call is let go, routed to the node the controller chose (any node with room:
  the global queue is what lets a program move), where its context is recomputed;
* **un-pause**: a paused session still in its tool gets its next call through without waiting.

A waiting call is a model-call activity that has not reached a node: the worker's plugin heartbeats it
while it waits, and a session whose program ends (or is reaped) is forgotten, its wait ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from hints import CacheState, HintModel
from orchestrator import THUNDER_PERIOD_S, ControlCore, ThunderAgent, thunder_loads, thunder_pause_hints

__all__ = ["LiveThunder"]

logger = logging.getLogger(__name__)


class LiveThunder:
    """The paused sessions' waiting calls and the periodic plan; see the module doc."""

    def __init__(
        self,
        core: ControlCore,
        node_states: Callable[[], Iterable[tuple[str, CacheState]]],
        node_of: Callable[[str], str | None],
        publish: Callable[[Sequence[HintModel]], object],
        period_s: float = THUNDER_PERIOD_S,
    ) -> None:
        """``node_states()``: every reachable node's latest cache state; ``node_of(session)``: the node its
        context is on; ``publish(hints)``: send hints to the nodes they concern (the runtime's)."""
        self.agent = ThunderAgent(period_s)
        self.core, self.node_states, self.node_of, self.publish = core, node_states, node_of, publish
        self._held: dict[str, asyncio.Future[str]] = {}  # session -> its restore's node
        self._running: dict[str, tuple[str, int]] = {}  # session -> (node, prompt) of its call in flight

    @property
    def period_s(self) -> float:
        return self.agent.period_s

    async def admit(self, session_id: str, context_tokens: int) -> str | None:
        """Before a session's model call: None when it may be routed as usual; else it waits for its
        restore and the node chosen for it is returned ("" when its program ended meanwhile: route as
        usual). A first call is never held (its session is not paused)."""
        if not self.agent.hold(session_id, context_tokens):
            return None
        held = asyncio.get_running_loop().create_future()
        self._held[session_id] = held
        try:
            return await held
        except asyncio.CancelledError:  # the activity was cancelled: its turn no longer waits (a retry
            self.agent.drop_waiting(session_id)  # of the call is held again while the session is paused)
            raise
        finally:
            self._held.pop(session_id, None)

    def started(self, session_id: str, node: str, prompt_tokens: int) -> None:
        self._running[session_id] = (node, prompt_tokens)

    def finished(self, session_id: str) -> None:
        self._running.pop(session_id, None)

    def forget(self, session_ids: Iterable[str]) -> None:
        """The sessions' program ended: they are no longer paused, and a call still waiting goes now."""
        for sid in session_ids:
            self.agent.forget(sid)
            self._running.pop(sid, None)
            held = self._held.pop(sid, None)
            if held is not None and not held.done():
                held.set_result("")  # routed as usual

    def control(self, now_s: float) -> None:
        """One period (``now_s``: the runtime's monotonic time, the core's clock)."""
        states = dict(self.node_states())
        running = [(sid, node, tokens) for sid, (node, tokens) in self._running.items()]
        loads = thunder_loads(running, self.core.pauses, self.core.context_tokens, self.node_of, now_s)
        capacity = {a: st.total_blocks * st.block_size for a, st in states.items()}
        idle = [a for a, st in states.items() if st.num_running == 0 and st.num_waiting == 0]
        plan = self.agent.control(loads, capacity, idle)
        if plan.pause:  # (each to the node the session is on)
            self.publish(thunder_pause_hints([sid for _node, sid in plan.pause]))
        for sid, node in plan.restore:
            held = self._held.get(sid)
            if held is not None and not held.done():
                held.set_result(node)
        if plan.pause or plan.restore:
            logger.info("thunderagent: paused %s, restored %s", [s for _n, s in plan.pause], plan.restore)
