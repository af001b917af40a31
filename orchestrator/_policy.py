"""The event-to-hints layer: program events in, validated hints out (see DESIGN.md, "Hint vocabulary").

A policy is a small object chosen by name from :data:`POLICIES`; the baselines (``vllm-default``,
``continuum``, ``kvflow``, ``thunderagent``) are policies too, so comparisons run on one code path.
Every time in a hint is a duration measured at the event's ``now_s`` (``ttl_s``, ``next_use_s``,
``program_age_s``); the node turns them into deadlines on its own clock.

Every hint is built through the pydantic models in :mod:`hints` inside :meth:`_BasePolicy._safe`, so a
policy bug (NaN, a negative duration, a ``prefill_reload`` that returns garbage) drops that hint with a
logged warning and a count in ``num_invalid_hints`` instead of sending it or raising into the caller.

Plain Python: no Temporal, gRPC, torch or engine_adapter import (it runs live and in replay).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, runtime_checkable

import networkx as nx

from hints import (
    MAX_HORIZON_S,
    MAX_PIN_TTL_S,
    EvictionOrder,
    HintModel,
    NextUse,
    Pin,
    Prefetch,
    Priority,
    Release,
)
from orchestrator._graph import steps_to_execution
from orchestrator._pause_model import PauseModel
from orchestrator._tracker import ProgramTracker
from orchestrator._ttl import ContinuumTTL

__all__ = [
    "POLICIES",
    "ContinuumPolicy",
    "Event",
    "HintFlowPolicy",
    "HintPolicy",
    "KVFlowPolicy",
    "ProgramEnded",
    "ThunderAgentPolicy",
    "Tick",
    "ToolEnded",
    "ToolStarted",
    "TurnEnded",
    "TurnStarted",
    "VLLMDefaultPolicy",
    "get_policy",
]

logger = logging.getLogger(__name__)


# ---- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TurnStarted:
    program_id: str
    session_id: str
    now_s: float
    context_tokens: int
    workflow: str = ""  # the program's type (Temporal workflow type): whose learned graph it follows


@dataclass(frozen=True, slots=True)
class TurnEnded:
    program_id: str
    session_id: str
    now_s: float
    context_tokens: int


@dataclass(frozen=True, slots=True)
class ToolStarted:
    program_id: str
    session_id: str
    tool: str
    now_s: float
    context_tokens: int
    workflow: str = ""


@dataclass(frozen=True, slots=True)
class ToolEnded:
    program_id: str
    session_id: str
    tool: str
    now_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class ProgramEnded:
    program_id: str
    now_s: float
    num_turns: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic re-decision (pin renewal, changed predictions)."""

    now_s: float


Event = TurnStarted | TurnEnded | ToolStarted | ToolEnded | ProgramEnded | Tick


@runtime_checkable
class HintPolicy(Protocol):
    """Turns one event into the hints to send now (possibly none).

    ``num_invalid_hints`` counts hints the policy computed but dropped because they failed validation.
    """

    name: str
    num_invalid_hints: int

    def on_event(self, event: Event) -> list[HintModel]: ...


# ---- shared state -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Parked:
    """A session whose context sits idle on the node: in a tool (``tool`` set) or between turns."""

    program_id: str
    context_tokens: int
    tool: str | None = None
    started_s: float = 0.0
    pin_expiry_s: float | None = None  # set while we hold a pin with ttl > 0


def _cap(x: float, hi: float) -> float:
    """Cap a finite value at ``hi``; leave NaN/inf/negatives alone so validation rejects them."""
    x = float(x)
    return min(x, hi) if math.isfinite(x) and x >= 0.0 else x


def _next_use(session_id: str, pred: Callable[[], float]) -> NextUse:
    return NextUse(session_id=session_id, next_use_s=_cap(pred(), MAX_HORIZON_S))


def _default_reload(n: int) -> float:
    return 1e-4 * n


class _BasePolicy:
    """Event dispatch, per-program/session bookkeeping and safe hint construction."""

    name = "base"
    default_renew_ahead_s = 0.0

    def __init__(
        self,
        pause_model: PauseModel | None = None,
        prefill_reload: Callable[[int], float] = _default_reload,
        *,
        rel_change: float = 0.1,
        renew_ahead_s: float | None = None,
    ) -> None:
        self.pause_model = pause_model if pause_model is not None else PauseModel()
        self.prefill_reload = prefill_reload
        self.ttl = ContinuumTTL(self.pause_model, prefill_reload)
        self.rel_change = rel_change
        # Renew a pin this long before it lapses (the Tick period), so a renewed lease never has a gap.
        self.renew_ahead_s = self.default_renew_ahead_s if renew_ahead_s is None else renew_ahead_s
        self.num_invalid_hints = 0
        self._program_start_s: dict[str, float] = {}
        self._parked: dict[str, _Parked] = {}
        # session -> (sent_at_s, next_use_s) of the last NextUse we sent, for incremental updates
        self._sent_next_use: dict[str, tuple[float, float]] = {}

    # -- safety ---------------------------------------------------------------------------------------
    def _safe(self, build: Callable[[], Any], what: str) -> Any | None:
        """Run ``build`` (which computes and validates a hint); on any error log, count and return None."""
        try:
            return build()
        except Exception as exc:  # a policy bug must not escape into the workflow or the replay loop
            self.num_invalid_hints += 1
            logger.warning("policy %s dropped an invalid %s: %s", self.name, what, exc)
            return None

    def _pin(self, session_id: str, ttl: Callable[[], float], reason: str) -> Pin | None:
        def lease() -> float:
            # A lease shorter than the re-decision period would lapse between two decisions to keep it.
            t = ttl()
            return max(t, self.renew_ahead_s) if t > 0.0 else t

        return self._safe(
            lambda: Pin(session_id=session_id, ttl_s=_cap(lease(), MAX_PIN_TTL_S), reason=reason),
            f"Pin({session_id})",
        )

    def _eviction_order(
        self, preds: dict[str, Callable[[], float]], now_s: float, *, only_changed: bool
    ) -> list[HintModel]:
        """One EvictionOrder with a NextUse per session (each validated on its own); with ``only_changed``,
        sessions whose predicted next-use *time* moved by at most ``rel_change`` of the prediction are left out."""
        entries: list[NextUse] = []
        for sid, pred in preds.items():
            entry: NextUse | None = self._safe(
                partial(_next_use, sid, pred),
                f"NextUse({sid})",
            )
            if entry is None:
                continue
            if only_changed and not self._changed(sid, now_s, entry.next_use_s):
                continue
            entries.append(entry)
        if not entries:
            return []
        order = self._safe(lambda: EvictionOrder(entries=entries), "EvictionOrder")
        if order is None:
            return []
        for e in entries:
            self._sent_next_use[e.session_id] = (now_s, e.next_use_s)
        return [order]

    def _changed(self, sid: str, now_s: float, next_use_s: float) -> bool:
        sent = self._sent_next_use.get(sid)
        if sent is None:
            return True
        sent_at, sent_value = sent
        drift = abs((now_s + next_use_s) - (sent_at + sent_value))
        return drift > self.rel_change * max(sent_value, next_use_s, 1e-3)

    def _priority(self, ev: TurnStarted) -> list[HintModel]:
        start = self._program_start_s.get(ev.program_id, ev.now_s)
        hint = self._safe(
            lambda: Priority(
                session_id=ev.session_id, program_id=ev.program_id, program_age_s=ev.now_s - start
            ),
            f"Priority({ev.session_id})",
        )
        return [hint] if hint is not None else []

    def _release(self, ev: ProgramEnded) -> list[HintModel]:
        hint = self._safe(lambda: Release(program_id=ev.program_id), f"Release({ev.program_id})")
        return [hint] if hint is not None else []

    def note_program_start(self, program_id: str, start_s: float) -> None:
        """Date a program from its submission (same clock as events' ``now_s``) rather than its first event,
        so program-level FCFS counts the time a program waited before it first ran."""
        if math.isfinite(start_s):
            self._program_start_s.setdefault(program_id, start_s)

    # -- dispatch -------------------------------------------------------------------------------------
    def on_event(self, event: Event) -> list[HintModel]:
        if isinstance(event, Tick):
            return self._on_tick(event)
        if isinstance(event, ProgramEnded):
            out = self._on_program_ended(event)
            self._forget_program(event.program_id)
            if event.num_turns >= 1:
                self.ttl.observe_program_finished(event.num_turns)
            else:
                logger.warning(
                    "policy %s: ProgramEnded(%s) with num_turns=%s ignored for eta",
                    self.name,
                    event.program_id,
                    event.num_turns,
                )
            return out
        self._program_start_s.setdefault(event.program_id, event.now_s)
        if isinstance(event, TurnStarted):
            self._parked.pop(event.session_id, None)
            self._sent_next_use.pop(event.session_id, None)
            return self._on_turn_started(event)
        if isinstance(event, TurnEnded):
            self._parked[event.session_id] = _Parked(
                event.program_id, event.context_tokens, started_s=event.now_s
            )
            return self._on_turn_ended(event)
        if isinstance(event, ToolStarted):
            self._parked[event.session_id] = _Parked(
                event.program_id, event.context_tokens, tool=event.tool, started_s=event.now_s
            )
            return self._on_tool_started(event)
        if isinstance(event, ToolEnded):
            d = event.duration_s
            if isinstance(d, int | float) and math.isfinite(d) and d >= 0.0:
                self.pause_model.observe(event.tool, d)
            else:
                logger.warning("policy %s: ToolEnded(%s) duration %r not observed", self.name, event.tool, d)
            parked = self._parked.get(event.session_id)
            if parked is not None:
                parked.tool = None
            return self._on_tool_ended(event)
        raise TypeError(f"unknown event type {type(event).__name__}")

    def _forget_program(self, program_id: str) -> None:
        self._program_start_s.pop(program_id, None)
        for sid in [s for s, p in self._parked.items() if p.program_id == program_id]:
            del self._parked[sid]
            self._sent_next_use.pop(sid, None)

    # -- hooks (default: no hints) --------------------------------------------------------------------
    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        return []

    def _on_turn_ended(self, ev: TurnEnded) -> list[HintModel]:
        return []

    def _on_tool_started(self, ev: ToolStarted) -> list[HintModel]:
        return []

    def _on_tool_ended(self, ev: ToolEnded) -> list[HintModel]:
        return []

    def _on_program_ended(self, ev: ProgramEnded) -> list[HintModel]:
        return []

    def _on_tick(self, ev: Tick) -> list[HintModel]:
        return []


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
    waiting to start (1 step).  Steps are scaled to seconds by the mean observed step time (turns and
    tools, 1 s until anything was seen).  Updates are incremental (only changed predictions are re-sent).
    """

    name = "kvflow"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._step_sum_s = 0.0
        self._step_count = 0
        self._turn_start_s: dict[str, float] = {}

    @property
    def mean_step_s(self) -> float:
        return self._step_sum_s / self._step_count if self._step_count else 1.0

    def _observe_step(self, d: float) -> None:
        if math.isfinite(d) and d >= 0.0:
            self._step_sum_s += d
            self._step_count += 1

    def _steps(self) -> dict[str, float]:
        g: nx.DiGraph = nx.DiGraph()
        running: set[str] = set()
        for sid, p in self._parked.items():
            g.add_node(f"next:{sid}")
            if p.tool is not None:
                g.add_edge(f"tool:{sid}", f"next:{sid}")
                running.add(f"tool:{sid}")
        values = steps_to_execution(g, running)
        return {sid: values[f"next:{sid}"] for sid in self._parked}

    def _order(self, now_s: float) -> list[HintModel]:
        steps = self._safe(self._steps, "steps-to-execution")
        if steps is None:
            return []
        mean = self.mean_step_s
        preds: dict[str, Callable[[], float]] = {
            sid: partial(operator.mul, s, mean) for sid, s in steps.items()
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


class HintFlowPolicy(ContinuumPolicy):
    """Ours: Continuum's pin rule plus an eviction order by the predicted next use of every parked session.

    For each session in a tool, next use = ``PauseModel.expected_remaining(tool, elapsed)`` (E[T - t | T > t],
    heavy-tail aware); for a session between turns, the program graph learned for its workflow type
    (:class:`ProgramTracker`: the most probable path to its next turn, or the horizon once it is dead).  Sent at ToolStarted; on Tick re-sent only for sessions whose predicted next-use
    time moved by more than ``rel_change`` (10%) of the prediction (incremental updates).  Priority by
    program age; Release at the end.
    """

    name = "hintflow"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tracker = ProgramTracker(self.pause_model)

    def _predictions(self, now_s: float) -> dict[str, Callable[[], float]]:
        """In a pause: the pause model's remaining time.  Between turns: the program graph's prediction
        (dead sessions: the horizon, so they go first); sessions neither can place are left to recency."""
        out: dict[str, Callable[[], float]] = {}
        between: dict[str, list[str]] = {}
        for sid, p in self._parked.items():
            if p.tool is not None:
                tool, elapsed = p.tool, max(now_s - p.started_s, 0.0)
                out[sid] = partial(self.pause_model.expected_remaining, tool, elapsed)
            else:
                between.setdefault(p.program_id, []).append(sid)
        for program_id, sids in between.items():
            graph_preds = self._safe(partial(self.tracker.predict, program_id, sids, now_s), "graph prediction")
            for sid, value in (graph_preds or {}).items():
                out[sid] = partial(float, value)
        return out

    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        self.tracker.turn_started(ev.program_id, ev.session_id, ev.now_s, ev.workflow)
        return super()._on_turn_started(ev)

    def _on_turn_ended(self, ev: TurnEnded) -> list[HintModel]:
        self.tracker.turn_ended(ev.program_id, ev.session_id, ev.now_s)
        return []

    def _on_program_ended(self, ev: ProgramEnded) -> list[HintModel]:
        self.tracker.program_ended(ev.program_id)
        return super()._on_program_ended(ev)

    def _prefetch(self, ev: ToolStarted, pin_ttl_s: float) -> list[HintModel]:
        """Ask for the context back shortly before the earliest likely return, unless the pin already
        covers the likely returns (then it never leaves the device and a prefetch would be a no-op)."""
        dist = self.pause_model.distribution(ev.tool)
        if pin_ttl_s >= dist.quantile(0.9):
            return []
        hint = self._safe(
            lambda: Prefetch(session_id=ev.session_id, at_s=_cap(0.8 * dist.quantile(0.25), MAX_HORIZON_S)),
            f"Prefetch({ev.session_id})",
        )
        return [hint] if hint is not None else []

    def _on_tool_started(self, ev: ToolStarted) -> list[HintModel]:
        self.tracker.tool_started(ev.program_id, ev.tool, ev.now_s, ev.workflow)
        out = self._pin_at_tool_start(ev)
        pin_ttl = next((h.ttl_s for h in out if isinstance(h, Pin)), 0.0)
        out += self._prefetch(ev, pin_ttl)
        tool = ev.tool
        out += self._eviction_order(
            {ev.session_id: lambda: self.pause_model.expected_remaining(tool, 0.0)},
            ev.now_s,
            only_changed=False,
        )
        return out

    def _on_tick(self, ev: Tick) -> list[HintModel]:
        return self._renew_pins(ev.now_s) + self._eviction_order(
            self._predictions(ev.now_s), ev.now_s, only_changed=True
        )


POLICIES: dict[str, Callable[..., HintPolicy]] = {
    VLLMDefaultPolicy.name: VLLMDefaultPolicy,
    ContinuumPolicy.name: ContinuumPolicy,
    KVFlowPolicy.name: KVFlowPolicy,
    ThunderAgentPolicy.name: ThunderAgentPolicy,
    HintFlowPolicy.name: HintFlowPolicy,
}
"""Registered policies by name; each factory takes ``pause_model=`` and ``prefill_reload=``."""


def get_policy(name: str, **kw: Any) -> HintPolicy:
    """Build the policy registered as ``name``; ValueError listing the known names otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    return factory(**kw)
