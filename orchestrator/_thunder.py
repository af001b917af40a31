"""ThunderAgent's pause/restore controller (arXiv 2602.13692), as a controller of the control core: no I/O.

Every ``period_s`` (Δt = 5 s), for each node::

    load = Σ_reasoning c  +  Σ_acting c · 2^(−t_tool)        (c: context tokens, t_tool: seconds in the tool)

and when ``load`` exceeds the node's device KV capacity the node thrashes: acting sessions (in a tool) are
paused, shortest context first (a paused context is recomputed later, at a cost growing like c², so the
short ones are the cheap ones to give up), until the load fits.  Pausing drops the context's device KV;
when its tool returns, the session's next turn waits in one global queue instead of being submitted.  At
each period the queue is restored, shortest first, onto whichever node has room (any replica: the global
queue is what lets a program move).  Paused sessions still in their tool are un-paused after that when
room remains.  If nothing fits anywhere but some node is idle, the queue head goes there, so a context
larger than a node's capacity cannot wait forever.

The shells carry the decisions out their own way: the replay drops the context's device blocks and starts
the held turn on the chosen node; the vLLM harness unpins the context and ranks it first to evict
(``thunder_pause_hints``), and holds the session's next request until its restore.  The unit paused is a
session (one KV context); for single-session workloads that is the program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hints import MAX_HORIZON_S, EvictionOrder, HintModel, NextUse, Pin
from orchestrator._control import Pause

__all__ = ["THUNDER_PERIOD_S", "SessionLoad", "ThunderAgent", "ThunderPlan", "thunder_loads", "thunder_pause_hints"]

THUNDER_PERIOD_S = 5.0
"""ThunderAgent's Δt: how often the controller weighs the nodes (the paper's setting)."""


@dataclass(frozen=True)
class SessionLoad:
    """One session of a node as ThunderAgent weighs it: ``tokens`` its context (a reasoning session: the
    prompt of its turn in flight), ``acting_s`` how long it has been in its tool (None: reasoning)."""

    session_id: str
    node: str
    tokens: int
    acting_s: float | None = None


@dataclass
class ThunderPlan:
    """What one period decided: sessions to pause (``(node, session)``), held turns to start now
    (``(session, node)``, in order), and paused sessions let go while still in their tool."""

    pause: list[tuple[str, str]] = field(default_factory=list)
    restore: list[tuple[str, str]] = field(default_factory=list)
    unpause: list[str] = field(default_factory=list)


class ThunderAgent:
    """The paused sessions and the global queue of their held turns; ``control`` runs every ``period_s``."""

    def __init__(self, period_s: float = THUNDER_PERIOD_S) -> None:
        self.period_s = period_s
        self.paused: set[str] = set()
        self.queue: list[tuple[str, int]] = []  # held turns: (session, its context tokens), in arrival order
        self.num_pauses = 0
        self.num_restores = 0

    def hold(self, session_id: str, context_tokens: int) -> bool:
        """A turn is ready: True when its session is paused, so the turn waits for a restore."""
        if session_id not in self.paused:
            return False
        self.queue.append((session_id, context_tokens))
        return True

    def forget(self, session_id: str) -> None:
        """The session's program ended: not paused, not waiting."""
        self.paused.discard(session_id)
        self.drop_waiting(session_id)

    def drop_waiting(self, session_id: str) -> None:
        """The session's held turn was given up (its call cancelled); it stays paused."""
        self.queue = [q for q in self.queue if q[0] != session_id]

    def control(
        self, sessions: Iterable[SessionLoad], capacity: Mapping[str, int], idle: Sequence[str]
    ) -> ThunderPlan:
        """One period over the ``sessions`` with a turn in flight or in a tool (paused ones included: the
        rule weighs the others and may un-pause these), the nodes' device ``capacity`` in tokens and the
        ``idle`` ones (no work at all); the shell carries the plan out in order."""
        plan = ThunderPlan()
        sessions = list(sessions)
        loads = dict.fromkeys(capacity, 0.0)
        acting: dict[str, list[tuple[int, float, str]]] = {a: [] for a in capacity}
        for s in sessions:
            if s.session_id in self.paused or s.node not in loads:
                continue
            if s.acting_s is None:
                loads[s.node] += s.tokens
            else:
                w = s.tokens * 2.0 ** (-s.acting_s)
                loads[s.node] += w
                acting[s.node].append((s.tokens, w, s.session_id))
        for node, cap in capacity.items():
            for _c, w, sid in sorted(acting[node], key=lambda x: (x[0], x[2])):
                if loads[node] <= cap:
                    break
                self.paused.add(sid)
                self.num_pauses += 1
                plan.pause.append((node, sid))
                loads[node] -= w
        # paused sessions still in their tool, this period's pauses included (their device KV is gone
        # either way: un-pausing only lets their next turn through without waiting in the queue)
        paused_acting = [s for s in sessions if s.session_id in self.paused and s.acting_s is not None]
        self._restore(plan, loads, capacity, list(idle), paused_acting)
        return plan

    def _restore(
        self, plan: ThunderPlan, loads: dict[str, float], capacity: Mapping[str, int], idle: list[str],
        paused_acting: list[SessionLoad],
    ) -> None:
        def room(c: int) -> str | None:
            fits = [a for a in loads if loads[a] + c <= capacity[a]] or idle[:1]
            return min(fits, key=lambda a: (loads[a], a)) if fits else None

        def place(sid: str, c: int, node: str) -> None:
            loads[node] += c
            if node in idle:  # a node given a turn has work now
                idle.remove(node)
            self.paused.discard(sid)

        waiting = sorted(self.queue, key=lambda q: (q[1], q[0]))
        self.queue = []
        for i, (sid, c) in enumerate(waiting):
            node = room(c)
            if node is None:
                self.queue = waiting[i:]
                return
            place(sid, c, node)
            self.num_restores += 1
            plan.restore.append((sid, node))
        for s in sorted(paused_acting, key=lambda s: s.tokens):  # (stable: ties in the shell's order)
            node = room(s.tokens)
            if node is None:
                return
            loads[node] += s.tokens
            self.paused.discard(s.session_id)
            plan.unpause.append(s.session_id)


def thunder_loads(
    running: Iterable[tuple[str, str, int]],
    pauses: Mapping[str, Pause],
    context_tokens: Callable[[str], int],
    node_of: Callable[[str], str | None],
    now_s: float,
) -> list[SessionLoad]:
    """What a live shell weighs (the harness, the runtime): each call in flight, ``(session, node, prompt
    tokens)``, then each session in its tool (the core's pause open, its tools not returned) with its
    context, on the node that holds it (``node_of``; a session on no known node is left out)."""
    loads = [SessionLoad(sid, node, tokens) for sid, node, tokens in running]
    busy = {s.session_id for s in loads}
    for sid, p in pauses.items():
        node = node_of(sid)
        if p.returned_s is None and sid not in busy and node is not None:
            loads.append(SessionLoad(sid, node, context_tokens(sid), now_s - p.started_s))
    return loads


def thunder_pause_hints(session_ids: Sequence[str]) -> list[HintModel]:
    """A pause as hints, for a node that has no pause of its own: the context unpinned and ranked first to
    evict (its next use as far off as a hint can say), so it is the first to go when memory is needed."""
    if not session_ids:
        return []
    pins: list[HintModel] = [Pin(session_id=sid, ttl_s=0.0) for sid in session_ids]
    order = EvictionOrder(entries=[NextUse(session_id=sid, next_use_s=MAX_HORIZON_S) for sid in session_ids])
    return [*pins, order]
