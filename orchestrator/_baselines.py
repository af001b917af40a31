"""The published policies we compare against, as hint policies on the same code path as ours."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from functools import partial
from typing import Any

import networkx as nx

from hints import (
    MAX_HORIZON_S,
    HintModel,
)
from orchestrator._events import ProgramEnded, Tick, ToolEnded, ToolStarted, TurnEnded, TurnStarted
from orchestrator._policy_base import _BasePolicy


# ---- policies ---------------------------------------------------------------------------------------
class VLLMDefaultPolicy(_BasePolicy):
    """Stock vLLM: no hints; the engine's own LRU prefix cache decides."""

    name = "vllm-default"


class ContinuumPolicy(_BasePolicy):
    """Continuum (arXiv 2511.02230): pin through a tool for tau*, program-level FCFS, release at the end.

    At ToolStarted: ``Pin(ttl = ContinuumTTL.ttl(tool, ctx))``.  On a Tick after a held pin expired while
    the tool still runs: re-decide on the conditional distribution (``ttl_remaining``) and renew, or send
    ``Pin(ttl_s=0)`` once when tau* = 0.  ToolEnded durations feed the pause model, ProgramEnded feeds eta.
    """

    name = "continuum"

    def _pin_at_tool_start(self, ev: ToolStarted) -> list[HintModel]:
        pin = self._pin(
            ev.session_id, lambda: self.ttl.ttl(ev.tool, ev.context_tokens), f"continuum:{ev.tool}"
        )
        if pin is None:
            return []
        parked = self._parked[ev.session_id]
        parked.pin_expiry_s = ev.now_s + pin.ttl_s if pin.ttl_s > 0.0 else None
        return [pin]

    def _renew_pins(self, now_s: float) -> list[HintModel]:
        out: list[HintModel] = []
        for sid, p in self._parked.items():
            if p.tool is None or p.pin_expiry_s is None or now_s + self.renew_ahead_s < p.pin_expiry_s:
                continue
            tool, elapsed, ctx = p.tool, max(now_s - p.started_s, 0.0), p.context_tokens
            pin = self._pin(
                sid,
                partial(self.ttl.ttl_remaining, tool, elapsed, ctx),
                f"continuum-renew:{tool}",
            )
            if pin is None:
                p.pin_expiry_s = None  # stop re-deciding a session whose rule keeps failing
                continue
            p.pin_expiry_s = now_s + pin.ttl_s if pin.ttl_s > 0.0 else None
            out.append(pin)
        return out

    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        return self._priority(ev)

    def _on_tool_started(self, ev: ToolStarted) -> list[HintModel]:
        return self._pin_at_tool_start(ev)

    def _on_tick(self, ev: Tick) -> list[HintModel]:
        return self._renew_pins(ev.now_s)

    def _on_program_ended(self, ev: ProgramEnded) -> list[HintModel]:
        return self._release(ev)


class KVFlowPolicy(_BasePolicy):
    """KVFlow (NeurIPS 2025): eviction order by steps-to-execution, no pins, release at the end.

    The event stream carries no agent DAG, so the DAG is the one the events show: a session in a tool
    waits on that tool (running, 0) and is 1 step away; a session parked between turns is a source
    waiting to start (1 step).  KVFlow is given the workflow's agent step graph by its framework, which
    also knows when an agent has taken its last step in a run: a framework that says so
    (:meth:`note_agent_finished`; the replay does, from the trace) moves that agent out of the graph, no
    step ever reaches it again, and its context goes first (``MAX_HORIZON_S``).  Steps are scaled to
    seconds by the mean observed step time (turns and tools, 1 s until anything was seen).  Updates are
    incremental (only changed predictions are re-sent).  Not modeled: KVFlow's prefetch of next-step agents
    from host memory.  What it could hide is bounded by the reloads it would move off the critical path:
    on the default swe-agent replay kvflow reloads 14,768 blocks, 9.9 s of copy time over 100 programs,
    at most about 0.1 s of its 19.26 s mean JCT.
    """

    name = "kvflow"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._step_sum_s = 0.0
        self._step_count = 0
        self._turn_start_s: dict[str, float] = {}
        self._finished_agents: dict[str, str] = {}  # session -> its program, until the program ends

    @property
    def mean_step_s(self) -> float:
        return self._step_sum_s / self._step_count if self._step_count else 1.0

    def _observe_step(self, d: float) -> None:
        if math.isfinite(d) and d >= 0.0:
            self._step_sum_s += d
            self._step_count += 1

    def event_dag(self) -> tuple[nx.DiGraph, set[str]]:
        """The agent step DAG the events show, and its running nodes: ``tool:S -> next:S`` for a session
        in a tool (the tool runs), a lone ``next:S`` for one parked between turns."""
        g: nx.DiGraph = nx.DiGraph()
        running: set[str] = set()
        for sid, p in self._parked.items():
            g.add_node(f"next:{sid}")
            if p.tool is not None:
                g.add_edge(f"tool:{sid}", f"next:{sid}")
                running.add(f"tool:{sid}")
        return g, running

    def _steps(self) -> dict[str, float]:
        """``steps_to_execution`` over :meth:`event_dag`, in closed form: that DAG has depth one, so every
        session is one step from running (1 + 0 behind its running tool, or 1 as a source); an agent the
        framework said is finished is never reached (infinite). Building the DAG with networkx at every
        event cost 25 s of a 300-program multi-agent replay; a test checks the two agree."""
        done = self._finished_agents
        return {sid: math.inf if sid in done else 1.0 for sid in self._parked}

    def note_agent_finished(self, session_id: str, now_s: float) -> list[HintModel]:
        """The framework's word that this agent (session) has taken its last step in its program: its
        context is the first to go, at once (its program's Release frees it later)."""
        if session_id not in self._parked:
            return []
        self._finished_agents[session_id] = self._parked[session_id].program_id
        return self._order(now_s)

    def _order(self, now_s: float) -> list[HintModel]:
        steps = self._safe(self._steps, "steps-to-execution")
        if steps is None:
            return []
        mean = self.mean_step_s
        preds: dict[str, Callable[[], float]] = {
            sid: partial(float, MAX_HORIZON_S) if math.isinf(s) else partial(operator.mul, s, mean)
            for sid, s in steps.items()
        }
        return self._eviction_order(preds, now_s, only_changed=True)

    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        self._turn_start_s[ev.session_id] = ev.now_s
        return []

    def _on_turn_ended(self, ev: TurnEnded) -> list[HintModel]:
        start = self._turn_start_s.pop(ev.session_id, None)
        if start is not None:
            self._observe_step(ev.now_s - start)
        return self._order(ev.now_s)

    def _on_tool_started(self, ev: ToolStarted) -> list[HintModel]:
        return self._order(ev.now_s)

    def _on_tool_ended(self, ev: ToolEnded) -> list[HintModel]:
        self._observe_step(float(ev.duration_s))
        return []

    def _on_tick(self, ev: Tick) -> list[HintModel]:
        return self._order(ev.now_s)

    def _on_program_ended(self, ev: ProgramEnded) -> list[HintModel]:
        done = self._finished_agents
        for sid in [sid for sid, pid in done.items() if pid == ev.program_id]:
            del done[sid]
        return self._release(ev)


class ThunderAgentPolicy(_BasePolicy):
    """ThunderAgent (arXiv 2602.13692) as hints: no pins, program-age priority, release at the end.

    Its real mechanism (every 5 s, pause acting programs when the node thrashes, restore reasoning ones
    first) is pause/restore of whole programs, which lives in the engine scheduler / replay, not here.
    """

    name = "thunderagent"

    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        return self._priority(ev)

    def _on_program_ended(self, ev: ProgramEnded) -> list[HintModel]:
        return self._release(ev)
