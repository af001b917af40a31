"""Hints inferred inside the engine for clients that only name their program (issue 5, item 2).

Why: most agents do not run on an orchestrator that sends hints, but every agent framework can add a
field to its OpenAI request. A client that sends ``extra_body={"vllm_xargs": {"program_id": P}}`` (and,
when it knows them, ``tool`` = the tool that runs after this turn, and ``is_last_turn``) gives the engine
enough to act as Continuum does, with no other process:

- **pause lengths**: the gap from the end of a session's turn k to the arrival of its turn k+1 is the
  tool's pause; it feeds an orchestrator :class:`PauseModel` per tool name (``"unknown"`` when not
  given). Per session, not per program: the workers of a multi-agent program run their turns and tools
  concurrently, and one program-wide "last turn ended at" would pair one worker's turn end with another
  worker's next arrival (and its tool), mixing their pauses and leases;
- **pin**: when a turn ends, its context is pinned for Continuum's ``tau*`` (:class:`ContinuumTTL`), with
  the reload cost measured on this engine (seconds per computed token, from its own steps) and the
  queueing delay of turns whose context was not kept (Continuum's T). Continuum's T starts at 0, so no
  pin pays until evicted turns have queued; here T is at least the engine's current prefill backlog
  times the measured seconds per token (the wait a turn arriving now would see), so pins start as soon
  as a queue forms (``ContinuumTTL``'s ``queue_delay_floor_s``). With a host tier a lost context is
  priced by what the tier actually gives back (:class:`HostTierTTL` with ``HostHitShare``): the copy for
  the share of evicted contexts' tokens returning turns found on the host, the re-prefill and T for the
  rest;
- **renewal**: when that pin runs out and the session is still in its pause, the pin is decided again on
  the pause so far (``ttl_remaining``: tau* of the remaining pause given it has lasted this long), as the
  orchestrator's policies renew theirs, so a pause longer than the first lease keeps its context when
  what is left of it is still worth the memory (``HINTFLOW_INFER_RENEW``, default on);
- **program FCFS**: a program's requests are dated by when the engine first saw the program;
- **release** (of the whole program): at the end of a turn flagged ``is_last_turn``, or once every session
  of the program has stayed silent for :data:`SILENT_FACTOR` times its own lease (at least
  :data:`SILENT_MIN_S`): its blocks go to the front of the free queue, since a program that does not come
  back should not cost anyone a cache hit.

Explicit hints win: a session that got any hint over ``PushHints`` in the last ``defer_s`` seconds is
never auto-pinned (the orchestrator knows more than pause statistics). No vLLM import (duck-typed book).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from predictors import ContinuumTTL, HostHitShare, HostTierTTL, PauseModel

from ._sessions import SessionBook, VSession

__all__ = ["SILENT_FACTOR", "SILENT_MIN_S", "HintInference", "env_float", "env_on", "infer_enabled"]

SILENT_FACTOR = 4.0
"""A program silent for this many times its last lease is taken as gone (its context is released)."""
SILENT_MIN_S = 30.0
"""...but never sooner than this: a short lease says little about how long a tool may take."""
UNKNOWN_TOOL = "unknown"


def env_on(name: str, default: str) -> bool:
    """A node switch from the environment: on unless it reads 0, false, no or off (``default`` when unset)."""
    return os.environ.get(name, default).strip().lower() not in {"0", "false", "no", "off"}


def env_float(name: str, default: float) -> float:
    """A node number from the environment (``default`` when unset or blank; ``inf`` allowed). A value that
    is not a number is a ValueError naming the variable, at the node's start, not a bare conversion error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def infer_enabled() -> bool:
    """``HINTFLOW_INFER_HINTS`` (default on): 0/false/no/off disables the inference."""
    return env_on("HINTFLOW_INFER_HINTS", "1")


@dataclass
class _Session:
    """One session's pause bookkeeping: its pauses are measured between its own turns."""

    turns: int = 0
    last_end_s: float | None = None  # when its last turn finished (None while one runs)
    tool: str = UNKNOWN_TOOL  # the tool running since that turn ended
    lease_s: float = 0.0  # the pin its last turn got, renewals included (0: none)
    context_tokens: int = 0  # its context when its last turn ended (what a renewed pin is priced on)
    last_turn: bool = False  # its running turn is flagged is_last_turn

    def silent(self, now: float, min_s: float) -> bool:
        """No turn in flight, and none for far longer than its lease."""
        return self.last_end_s is not None and now - self.last_end_s >= max(min_s, SILENT_FACTOR * self.lease_s)


@dataclass
class _Program:
    first_seen_s: float
    turns: int = 0  # over all its sessions (eta counts a program's turns)
    sessions: dict[str, _Session] = field(default_factory=dict)


class HintInference:
    """Per-session pause statistics, per-program FCFS and releases, and the pins they imply (module docstring).

    Called by the scheduler under its lock: ``on_request`` (arrival), ``on_turn_end`` (before the book
    takes the finished request's blocks), ``after_turn_end``, ``on_admitted``, ``observe_step``, ``sweep``.
    """

    def __init__(
        self,
        book: SessionBook,
        *,
        defer_s: float = 60.0,
        min_samples: int = 20,
        default_pause_s: float = 1.0,
        reload_s_per_token: float | None = None,
        silent_min_s: float = SILENT_MIN_S,
        clock: Callable[[], float] | None = None,
        backlog_tokens: Callable[[], int] | None = None,
        host_reload_s_per_token: float | None = None,
        pool_tokens: Callable[[], float] | None = None,
        host_hits: HostHitShare | None = None,
        prefill_share: Callable[[], float] | None = None,
        unpinned_survival: Callable[[], float] | None = None,
        measured_price: bool = True,
        renew: bool = True,
    ) -> None:
        """``reload_s_per_token`` fixes the re-prefill cost (a profile, as Continuum's fit) instead of
        measuring it; ``silent_min_s`` is the least silence after which a program is released;
        ``backlog_tokens()`` (prompt tokens the engine still has to compute) gives T its floor.
        ``host_reload_s_per_token``: the node has a host tier, and a context not pinned is copied back at
        this cost per token (``HostTierTTL``: pins are priced by it for the share of evicted contexts the
        tier gives back, as lost contexts, re-prefill and T, for the rest: the measured price is for nodes
        without a tier here, since with the short host tier three paired real rounds put it level with T,
        0.84-0.93x against 0.75-0.99x stock's mean JCT; docs/benchmarks.md).
        ``pool_tokens()``: the device pool in tokens; pins are then priced by the share of it they hold
        (``ContinuumTTL``'s memory share, as the orchestrator's ``hintflow`` policy prices them).
        ``host_hits``: the node's measure of what its host tier gives back (the scheduler's, which it also
        reports in ``CacheState``); a fresh one fed by ``observe_host_reload`` if not given.
        ``prefill_share()``, ``unpinned_survival()``: the node's readings (the scheduler's
        ``PrefillShare`` and ``UnpinnedSurvival``); with them and ``measured_price``, a node without a host
        tier prices pins by ``ContinuumTTL``'s measured price, not T (``HINTFLOW_INFER_MEASURED_PRICE=0``:
        T with the backlog floor, as before). ``renew``: an inferred pin that runs out during its pause is
        decided again on the pause so far (``renewal_s``; ``HINTFLOW_INFER_RENEW``)."""
        self.book = book
        self.renew = renew
        self.clock = clock or book.clock
        self.defer_s = defer_s
        self.pauses = PauseModel(min_samples=min_samples, default_mean_s=default_pause_s)
        self.backlog_tokens = backlog_tokens
        self.rule: ContinuumTTL
        # What came back of evicted contexts from the host tier (observe_host_reload)
        self.host_hits = host_hits if host_hits is not None else HostHitShare()
        if host_reload_s_per_token is not None:
            host_s = host_reload_s_per_token
            self.rule = HostTierTTL(
                self.pauses, lambda tokens: host_s * tokens, miss_reload=self.prefill_reload_s,
                host_hit_fraction=self.host_hit_fraction, pool_tokens=pool_tokens,
                queue_delay_floor_s=self.backlog_s,
            )  # fmt: skip
        elif measured_price and prefill_share is not None:
            self.rule = ContinuumTTL(self.pauses, self.prefill_reload_s, pool_tokens=pool_tokens,
                                     prefill_share=prefill_share, unpinned_survival=unpinned_survival)
        else:
            # T at least the wait behind the prefill backlog: a prior from this engine's own measurements
            self.rule = ContinuumTTL(self.pauses, self.prefill_reload_s, pool_tokens=pool_tokens,
                                     queue_delay_floor_s=self.backlog_s)
        self.programs: dict[str, _Program] = {}
        self.explicit_s: dict[str, float] = {}  # session id -> when it last got a hint over PushHints
        self.s_per_token = reload_s_per_token or 1e-4  # re-prefill cost, refined from this engine's steps
        self.measure_reload = reload_s_per_token is None
        self.silent_min_s = silent_min_s
        self.inferred_pins = 0
        self.inferred_releases = 0
        self.inferred_renewals = 0
        self._next_sweep_s = 0.0
        self._pinned: set[str] = set()  # sessions whose current pin this inference set

    # ---- costs ---------------------------------------------------------------------------------
    def prefill_reload_s(self, context_tokens: int) -> float:
        return self.s_per_token * context_tokens

    def backlog_s(self) -> float:
        """Seconds of prefill already queued in the engine (T's floor; 0 without a backlog callback)."""
        return self.s_per_token * self.backlog_tokens() if self.backlog_tokens is not None else 0.0

    def observe_host_reload(self, history_tokens: int, device_hit_tokens: int, host_hit_tokens: int) -> None:
        """A returning turn was admitted: of its ``history_tokens`` (what its session's last turn had), the
        part not found on the device was or was not loaded from the host tier. Feeds ``host_hit_fraction``."""
        self.host_hits.observe(history_tokens, device_hit_tokens, host_hit_tokens)

    def host_hit_fraction(self) -> float:
        """The share of evicted contexts' tokens the host tier gave back lately (1 before any was seen:
        a host tier is assumed to work until it is seen not to)."""
        return self.host_hits.fraction()

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A model step of ``tokens`` took ``seconds``: prefill-sized steps refine the reload cost (EWMA)."""
        if self.measure_reload and tokens >= 64 and seconds > 0 and math.isfinite(seconds):
            self.s_per_token = 0.9 * self.s_per_token + 0.1 * (seconds / tokens)

    def note_explicit(self, session_id: str) -> None:
        """The orchestrator speaks for this session now: an inferred pin it still holds is dropped."""
        self.explicit_s[session_id] = self.clock()
        s = self.book.sessions.get(session_id)
        if session_id in self._pinned and s is not None:
            self.book.drop_pin(s)
        self._pinned.discard(session_id)

    def _explicit(self, session_id: str, now: float) -> bool:
        return now - self.explicit_s.get(session_id, -math.inf) < self.defer_s

    # ---- events --------------------------------------------------------------------------------
    def on_request(self, s: VSession, extra: dict[str, Any]) -> None:
        """A turn arrives: close the pause it ends, remember what it says about the next one."""
        now = self.clock()
        p = self.programs.get(s.program_id)
        if p is None:
            p = self.programs[s.program_id] = _Program(first_seen_s=now)
        st = p.sessions.setdefault(s.session_id, _Session())
        if st.last_end_s is not None:
            self.pauses.observe(st.tool, max(0.0, now - st.last_end_s))
        st.last_end_s = None
        st.turns += 1
        p.turns += 1
        tool = extra.get("tool")
        st.tool = str(tool) if tool else UNKNOWN_TOOL
        st.last_turn = bool(extra.get("is_last_turn"))
        if s.program_start_s is None:
            s.program_start_s = p.first_seen_s  # program FCFS; a Priority hint overrides it

    @property
    def priced_queue_delay_s(self) -> float:
        """The T this node's pins are priced with: with a host tier, the T of the share of a context its tier
        does not give back (``HostTierTTL.queue_delay_s`` is 0 by design: the share that comes back is a
        copy, not a queue), else Continuum's, at least the backlog floor. What the node's log line shows."""
        rule = self.rule
        return rule.miss_queue_delay_s() if isinstance(rule, HostTierTTL) else rule.queue_delay_s

    def on_admitted(self, s: VSession, queue_delay_s: float, kept: bool) -> None:
        """Continuum's T: how long turns whose context was not kept waited to be admitted."""
        st = self._session(s)
        if st is not None and st.turns > 1 and not kept and queue_delay_s >= 0:  # a returning turn
            self.rule.observe_evicted_queue_delay(queue_delay_s)

    def on_turn_end(self, s: VSession, context_tokens: int) -> None:
        """Pin the finished turn's context for tau* unless the orchestrator speaks for this session."""
        now = self.clock()
        st = self._session(s)
        if st is None or len(s.live) > 1:
            return  # another turn of the session is in flight: its end decides
        st.last_end_s = now
        st.lease_s = 0.0
        st.context_tokens = context_tokens
        if st.last_turn or s.released or self._explicit(s.session_id, now):
            return
        ttl = self.rule.ttl(st.tool, context_tokens)
        st.lease_s = ttl
        if ttl > 0:
            self.book.set_pin(s, ttl)
            self._pinned.add(s.session_id)
            self.inferred_pins += 1

    def renewal_s(self, s: VSession) -> float:
        """A further lease for a pin of this inference that ran out (the book asks, ``SessionBook.expire``):
        tau* of the rest of the pause given it has lasted this long, 0 to let it go. Only while the session
        is in the pause its pin was for, and the orchestrator does not speak for it."""
        now = self.clock()
        st = self._session(s)
        if (
            st is None or st.last_end_s is None or st.last_turn or s.session_id not in self._pinned
            or self._explicit(s.session_id, now)
        ):  # fmt: skip
            return 0.0
        elapsed_s = now - st.last_end_s
        ttl_s = self.rule.ttl_remaining(st.tool, elapsed_s, st.context_tokens)
        if ttl_s > 0.0:
            st.lease_s = elapsed_s + ttl_s
            self.inferred_renewals += 1
        return ttl_s

    def after_turn_end(self, s: VSession) -> None:
        """The blocks are placed; a last turn releases the whole program now."""
        p = self.programs.get(s.program_id)
        st = self._session(s)
        if p is None or st is None or not st.last_turn or s.live:
            return
        if not self._explicit(s.session_id, self.clock()):
            self.book.release_program(s.program_id)
            self.inferred_releases += 1
        self.rule.observe_program_finished(p.turns)
        self._drop(s.program_id)

    def sweep(self) -> None:
        """Release programs silent far past their lease (cheap: runs once a second)."""
        now = self.clock()
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + 1.0
        for pid, p in list(self.programs.items()):
            if not all(st.silent(now, self.silent_min_s) for st in p.sessions.values()):
                continue
            members = [self.book.sessions[sid] for sid in self.book.programs.get(pid, ()) if sid in self.book.sessions]
            if any(m.live for m in members):
                continue
            if members and not any(self._explicit(m.session_id, now) for m in members):
                self.book.release_program(pid)
                self.inferred_releases += 1
            self._drop(pid)

    def _session(self, s: VSession) -> _Session | None:
        p = self.programs.get(s.program_id)
        return p.sessions.get(s.session_id) if p is not None else None

    def _drop(self, program_id: str) -> None:
        self.programs.pop(program_id, None)
        self._pinned -= set(self.book.programs.get(program_id, ())) | {program_id}
        for sid in [sid for sid, t in self.explicit_s.items() if self.clock() - t > self.defer_s]:
            del self.explicit_s[sid]
