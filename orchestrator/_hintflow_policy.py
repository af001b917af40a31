"""Ours: the ``hintflow`` policy."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from hints import (
    MAX_HORIZON_S,
    HintModel,
    Pin,
    Prefetch,
)
from orchestrator._baselines import ContinuumPolicy
from orchestrator._events import ProgramEnded, Tick, ToolStarted, TurnEnded, TurnStarted
from orchestrator._policy_base import _cap
from orchestrator._tracker import ProgramTracker
from predictors import ContinuumTTL, HostTierTTL


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
        self._host_reload_changed()  # this policy's own price from the start (the base built Continuum's)

    def _host_reload_changed(self) -> None:
        """With a host tier an evicted context comes back by copy, not by re-prefill: a pin saves only the
        cheaper of the two, so it is priced by that (Continuum prices re-prefill alone), and without
        Continuum's queueing term (HostTierTTL), for the share of evicted contexts the tier does give
        back (``host_hit_fraction``, the node's measure); the rest is priced as a lost context, as the vLLM
        node's own inference prices it: by re-prefill and T (``measured_price`` is for nodes without a tier;
        why: ``HostTierTTL``). The estimates learned so far carry over."""
        old = self.ttl
        floor = self.queue_delay_floor  # T at least the wait behind the nodes' prefill backlog, as on the node
        if self.host_reload is None and self.prefill_share is not None:  # the measured price (ContinuumTTL)
            self.ttl = ContinuumTTL(self.pause_model, self.prefill_reload, pool_tokens=self._pool_reading,
                                    prefill_share=self.prefill_share, unpinned_survival=self.unpinned_survival)
        elif self.host_reload is None:
            self.ttl = ContinuumTTL(self.pause_model, self.prefill_reload, pool_tokens=self.pool_tokens,
                                    queue_delay_floor_s=floor, count_queue_delay=self.queue_delay)
        else:
            prefill, host = self.prefill_reload, self.host_reload
            self.ttl = HostTierTTL(
                self.pause_model, lambda n: min(float(prefill(n)), float(host(n))), pool_tokens=self.pool_tokens,
                miss_reload=prefill if self.host_hit_fraction is not None else None,
                host_hit_fraction=self.host_hit_fraction, queue_delay_floor_s=floor,
                count_queue_delay=self.queue_delay,  # (T weighs only the share the tier does not give back)
            )
        self.ttl.learn_from(old)

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
            graph_preds = self._safe(
                partial(self.tracker.predict, program_id, sids, now_s), "graph prediction"
            )
            for sid, value in (graph_preds or {}).items():
                out[sid] = partial(float, value)
        return out

    def _on_turn_started(self, ev: TurnStarted) -> list[HintModel]:
        self.tracker.turn_started(ev.program_id, ev.session_id, ev.now_s, ev.workflow)
        return super()._on_turn_started(ev)

    def _on_turn_ended(self, ev: TurnEnded) -> list[HintModel]:
        """Pin at the turn's end for the tool the graph says comes next (Continuum's moment), so the
        context is held from the first instant: waiting for the tool to start leaves a gap (the runtime
        scheduling the tool, tens of ms) in which competing load evicts it.  ToolStarted re-decides."""
        self.tracker.turn_ended(ev.program_id, ev.session_id, ev.now_s)
        tool = self.tracker.likely_next_tool(ev.program_id, ev.session_id)
        if tool is None:
            return []
        pin = self._pin(ev.session_id, lambda: self.ttl.ttl(tool, ev.context_tokens), f"turn-end:{tool}")
        if pin is None or pin.ttl_s <= 0.0:
            return []
        self._parked[ev.session_id].pin_expiry_s = ev.now_s + pin.ttl_s
        return [pin]

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
