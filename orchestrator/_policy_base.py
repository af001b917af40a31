"""The shared mechanism of every hint policy: per-program bookkeeping, safe hint construction, incremental
EvictionOrder updates.  Policies (baselines and ours) subclass :class:`_BasePolicy` and override hooks."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from hints import (
    MAX_HORIZON_S,
    MAX_PIN_TTL_S,
    MAX_PROGRAM_AGE_S,
    EvictionOrder,
    HintModel,
    NextUse,
    Pin,
    Priority,
    Release,
)
from orchestrator._events import (
    Event,
    ProgramEnded,
    Tick,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
)
from predictors import ContinuumTTL, PauseModel

logger = logging.getLogger("orchestrator._policy")


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
        min_change_s: float = 0.0,
        renew_ahead_s: float | None = None,
        host_reload: Callable[[int], float] | None = None,
        pool_tokens: Callable[[], float] | None = None,
        memory_share: bool = False,
        host_hit_fraction: Callable[[], float] | None = None,
        backlog_floor: bool = True,
        queue_delay: bool = True,
        measured_price: bool = True,
    ) -> None:
        self.pause_model = pause_model if pause_model is not None else PauseModel()
        self.prefill_reload = prefill_reload
        # Seconds to copy a context of n tokens back from the node's host tier (None: no host tier).  The
        # baselines price a lost context as their papers do; ours may use it (see HintFlowPolicy).
        self.host_reload = host_reload
        # The share of an evicted context that the nodes' host tier gives back (``CacheState``'s
        # ``host_hit_fraction``, read at each decision; None: all of it). The rest is re-prefilled.
        self.host_hit_fraction = host_hit_fraction
        # Tokens of device KV on the nodes, read at each pin decision (None: not known).  The baselines
        # price a pin as their papers do; ours, with ``memory_share``, by the share of the pool it holds
        # (HintFlowPolicy; off by default here, on in the vLLM node's own inference: docs/tuning.md).
        self.pool_tokens = pool_tokens if memory_share else None
        self.memory_share = memory_share
        self._pool_reading = pool_tokens  # (the measured price reads the pool whatever ``memory_share``)
        # A floor under Continuum's T, read at each decision: the wait behind the nodes' prefill backlog
        # (``set_queue_delay_floor``; the vLLM node's own inference has the same floor).  Only
        # ``HintFlowPolicy`` uses it, and only with ``backlog_floor``; the baselines price T as their papers do.
        self.backlog_floor = backlog_floor
        # Whether a pin is worth Continuum's queueing term T as well as the re-prefill, for the share of a
        # context the node loses (with a host tier, ``HostTierTTL``: what the tier does not give back)
        # (``HintFlowPolicy`` only, on by default; off wins on overloaded nodes: docs/tuning.md; the
        # baselines price T as their papers do).
        self.queue_delay = queue_delay
        self.queue_delay_floor: Callable[[], float] | None = None
        # With no host tier, price a pin by what the nodes measure (``ContinuumTTL``'s measured price: the
        # prefill share of their step time, what they keep of unpinned contexts, the pool share a pin
        # holds) instead of Continuum's T (``HintFlowPolicy`` only; ``set_node_signals`` gives the readings).
        self.measured_price = measured_price
        self.prefill_share: Callable[[], float] | None = None
        self.unpinned_survival: Callable[[], float] | None = None
        self.ttl = ContinuumTTL(self.pause_model, prefill_reload)
        self.rel_change = rel_change
        # ... and by more than this many seconds: a prediction that stays "D from now" (memoryless) moves
        # its deadline with the clock, and would be re-sent every rel_change * D seconds, every tick for
        # a small D; this bounds that re-send rate per session.
        self.min_change_s = min_change_s
        # Renew a pin this long before it lapses (the Tick period), so a renewed lease never has a gap.
        self.renew_ahead_s = self.default_renew_ahead_s if renew_ahead_s is None else renew_ahead_s
        self.num_invalid_hints = 0
        self._program_start_s: dict[str, float] = {}
        self._parked: dict[str, _Parked] = {}
        # session -> (sent_at_s, next_use_s) of the last NextUse we sent, for incremental updates
        self._sent_next_use: dict[str, tuple[float, float]] = {}

    def set_host_reload(
        self, host_reload: Callable[[int], float] | None, host_hit_fraction: Callable[[], float] | None = None
    ) -> None:
        """The nodes have (or no longer have) a host tier: seconds to copy a context of n tokens back, and
        the share of an evicted context the tier gives back (None: all). The baselines price a lost
        context as their papers do and ignore both; ``HintFlowPolicy`` re-prices."""
        self.host_reload = host_reload
        self.host_hit_fraction = host_hit_fraction
        self._host_reload_changed()

    def set_pool_tokens(self, pool_tokens: Callable[[], float] | None) -> None:
        """The nodes' device pool in tokens, read at each decision (the live runtime learns it from
        ``CacheState``); only ``HintFlowPolicy`` uses it, unless built with ``memory_share=False``."""
        self.pool_tokens = pool_tokens if self.memory_share else None
        self._pool_reading = pool_tokens
        self._host_reload_changed()

    def set_node_signals(self, prefill_share: Callable[[], float] | None,
                         unpinned_survival: Callable[[], float] | None) -> None:
        """The nodes' prefill share of step time and what they keep of contexts no pin held (``CacheState``),
        read at each decision; ``HintFlowPolicy`` prices pins by them when built with ``measured_price``."""
        self.prefill_share = prefill_share if self.measured_price else None
        self.unpinned_survival = unpinned_survival if self.measured_price else None
        self._host_reload_changed()

    def set_queue_delay_floor(self, floor_s: Callable[[], float] | None) -> None:
        """The wait a turn that recomputes its context would see now, behind the nodes' prefill backlog
        (the runtime learns it from ``CacheState.prefill_backlog_tokens``); a floor under T for
        ``HintFlowPolicy`` when built with ``backlog_floor``."""
        self.queue_delay_floor = floor_s if self.backlog_floor else None
        self._host_reload_changed()

    def _host_reload_changed(self) -> None:
        return None

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
            if only_changed and sid in self._sent_next_use:
                # Most predictions move too little to re-send, every tick: for a session already sent once
                # (its id is valid), check a valid value before building and validating a hint for it.
                # Anything else (an error, NaN, a negative) takes the checked path below, which counts it.
                try:
                    value = _cap(pred(), MAX_HORIZON_S)
                except Exception:
                    value = math.nan
                if 0.0 <= value <= MAX_HORIZON_S and not self._changed(sid, now_s, value):
                    continue
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
        return drift > max(self.rel_change * max(sent_value, next_use_s, 1e-3), self.min_change_s)

    def _priority(self, ev: TurnStarted) -> list[HintModel]:
        start = self._program_start_s.get(ev.program_id, ev.now_s)
        hint = self._safe(
            lambda: Priority(
                session_id=ev.session_id, program_id=ev.program_id,
                program_age_s=_cap(ev.now_s - start, MAX_PROGRAM_AGE_S),
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
