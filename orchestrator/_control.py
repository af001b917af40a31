"""The control core: program events and node states in, hints addressed to nodes out; no I/O, no clock.

The live runtime (``workflows/_runtime.py``), the replay (``replay/_sim.py``) and the real-vLLM harness
(``replay/_vllm_agents.py``) are shells over one ``ControlCore``: each turns what it observes into calls
here, with the time as an argument, and delivers what comes back its own way (gRPC publishers, in-process
nodes, one gRPC stream).  So the rules below hold alike wherever a policy runs:

* **a pause** is open from ``ToolStarted`` to the session's next turn, tool or the program's end: what a
  pin must cover is the whole time the context sits idle.  Parallel tools of a session are one pause,
  until every one returned.  A pause whose tool returned and whose next turn does not come within
  ``tool_grace_s`` (it runs on another worker, or the program was terminated) ends at the tool's return;
* **ticks** reach the policy only while a pause is open (pins are renewed for paused sessions; between
  pauses every decision comes with an event);
* **a policy that raises** is logged (the first time per event kind with its traceback) and counted in
  ``num_policy_errors``; the loop goes on without that event's hints;
* **a user's policy object** has its hints validated again before they leave (``validate``); a bad one is
  dropped and counted in ``policy.num_invalid_hints`` (registered policies build theirs validated);
* **pricing**: a policy built here by name learns the nodes' device pool (the smallest), whether every
  node has a host tier (then pins are priced by the copy back, the slowest node's), the share of
  evicted contexts the host tiers give back (the mean over the nodes), and the wait behind their prefill
  backlogs (the mean; ``hintflow`` takes it as a floor under Continuum's T, as the vLLM node's own
  inference does), from ``node_seen``;
* **the cost of a re-prefill** is learned from finished turns (``turn_done``: ``PrefillEstimator``), and
  Continuum's T from the queue wait of turns that recomputed context;
* **addressing**: a hint about a session goes to the node its shell says holds it (``node_of``), else to
  every node; ``Release`` to every node (``hints_by_node``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from hints import EvictionOrder, Expect, HintModel, Pin, Prefetch, Priority, Release
from orchestrator._addressing import hints_by_node
from orchestrator._events import ProgramEnded, Tick, ToolEnded, ToolStarted, TurnEnded, TurnStarted
from orchestrator._policy import POLICIES, HintPolicy, get_policy
from orchestrator._policy_spec import PolicySpec
from orchestrator._prefill import PrefillEstimator

__all__ = ["ControlCore", "Pause"]

logger = logging.getLogger(__name__)

_HINT_TYPES: tuple[type, ...] = (Priority, Pin, EvictionOrder, Prefetch, Expect, Release)
Reading = float | Callable[[], float]
"""A node figure given as a value, or as a function read at each decision (a node's live measure)."""


def _read(x: Reading) -> float:
    return float(x() if callable(x) else x)


@dataclass
class Pause:
    """A session's pause in progress: from its tool's start to its next turn."""

    program_id: str
    tool: str
    started_s: float
    returned_s: float | None = None  # when its tools returned (the context waits for the next turn)


@dataclass
class _NodeKnobs:
    host_tier: bool
    pool_tokens: float
    host_hit_fraction: Reading
    reload_s_per_token: Reading
    prefill_backlog_tokens: Reading
    prefill_share: Reading
    unpinned_survival: Reading


class ControlCore:
    """One policy, fed the way every shell feeds it; see the module doc for the rules."""

    def __init__(
        self,
        policy: str | PolicySpec | HintPolicy,
        *,
        nodes: Sequence[str] = (),
        node_of: Callable[[str], str | None] = lambda _sid: None,
        prefill_prior: Callable[[int], float] | None = None,
        tool_grace_s: float = math.inf,
        rewrite: Callable[[Any, list[HintModel]], list[HintModel]] | None = None,
        on_event: Callable[[Any], None] | None = None,
        on_invalid: Callable[[str], None] | None = None,
        **policy_kw: Any,
    ) -> None:
        """``policy``: a registered name or spec (built here, with ``policy_kw`` and the learned prefill
        cost), or a policy object (left as configured: ``node_seen`` does not re-price it).
        ``rewrite(event, hints)``: a controller's say on the policy's hints (the replay's clairvoyant
        ``bound`` row).  ``on_event``: told every event fed to the policy, ticks included.  ``on_invalid``:
        told the kind of each hint ``validate`` dropped (the live runtime counts them in a metric)."""
        self.prefill = PrefillEstimator(prefill_prior)
        self._auto = not hasattr(policy, "on_event")
        if isinstance(policy, PolicySpec):
            policy = policy.build(POLICIES, prefill_reload=self.prefill.reload_s, **policy_kw)
        elif isinstance(policy, str):
            policy = get_policy(policy, prefill_reload=self.prefill.reload_s, **policy_kw)
        self.policy: HintPolicy = policy  # type: ignore[assignment]
        self.validate = type(self.policy) not in POLICIES.values()
        self.nodes = list(nodes)
        self.node_of = node_of
        self.tool_grace_s = float(tool_grace_s)
        self.rewrite, self.on_event, self.on_invalid = rewrite, on_event, on_invalid
        self.pauses: dict[str, Pause] = {}  # session -> its open pause
        self._context: dict[str, tuple[str, int]] = {}  # session -> (program, its last context length)
        self._tools_running: dict[str, int] = {}  # session -> its tools running now (parallel tools)
        self._knobs: dict[str, _NodeKnobs] = {}
        self._host_priced = False
        self.num_policy_errors = 0
        self._logged: set[object] = set()
        set_pool = getattr(self.policy, "set_pool_tokens", None)
        if self._auto and set_pool is not None:
            set_pool(lambda: min((k.pool_tokens for k in self._knobs.values()), default=0.0))
        set_floor = getattr(self.policy, "set_queue_delay_floor", None)
        if self._auto and set_floor is not None:
            set_floor(self._backlog_wait_s)
        set_signals = getattr(self.policy, "set_node_signals", None)
        if self._auto and set_signals is not None:
            set_signals(partial(self._mean_reading, "prefill_share"), partial(self._mean_reading, "unpinned_survival"))

    # ---- nodes --------------------------------------------------------------------------------------
    def node_seen(
        self, node: str, *, host_tier: bool, pool_tokens: float, host_hit_fraction: Reading = 1.0,
        reload_s_per_token: Reading = 0.0, prefill_backlog_tokens: Reading = 0.0,
        prefill_share: Reading = 0.0, unpinned_survival: Reading = 0.0,
    ) -> None:
        """What a node's cache state says about pricing (see the module doc); call it with every state."""
        self._knobs[node] = _NodeKnobs(host_tier, float(pool_tokens), host_hit_fraction, reload_s_per_token,
                                       prefill_backlog_tokens, prefill_share, unpinned_survival)
        if node not in self.nodes:
            self.nodes.append(node)
        every = bool(self.nodes) and all(a in self._knobs and self._knobs[a].host_tier for a in self.nodes)
        set_host_reload = getattr(self.policy, "set_host_reload", None)
        if not self._auto or set_host_reload is None or every == self._host_priced:
            return
        self._host_priced = every
        knobs, nodes = self._knobs, self.nodes

        def copy_back_s(n: int) -> float:  # the slowest node's copy: a policy does not know where a session is
            return n * max(_read(knobs[a].reload_s_per_token) for a in nodes if a in knobs)

        def hit_share() -> float:
            shares = [_read(knobs[a].host_hit_fraction) for a in nodes if a in knobs]
            return sum(shares) / len(shares) if shares else 1.0

        set_host_reload(copy_back_s if every else None, hit_share if every else None)
        logger.info("host tier on every node: %s; pins priced by %s", every, "the copy back" if every else "re-prefill")

    def _mean_reading(self, name: str) -> float:
        """The mean over the nodes of one of their readings (0 before any node was seen)."""
        values = [_read(getattr(k, name)) for k in self._knobs.values()]
        return sum(values) / len(values) if values else 0.0

    def _backlog_wait_s(self) -> float:
        """The wait behind the nodes' prefill backlog (the mean over the nodes, priced at the learned
        re-prefill cost): what a turn that recomputes its context would queue behind now."""
        waits = [self.prefill.reload_s(round(_read(k.prefill_backlog_tokens))) for k in self._knobs.values()]
        return sum(waits) / len(waits) if waits else 0.0

    # ---- events -------------------------------------------------------------------------------------
    def program_started(self, program_id: str, start_s: float) -> None:
        """Date the program from its submission (program-level FCFS counts the time it waited to run)."""
        note = getattr(self.policy, "note_program_start", None)
        if note is not None:
            note(program_id, start_s)

    def turn_started(
        self, program_id: str, session_id: str, now_s: float, context_tokens: int, workflow: str = ""
    ) -> list[HintModel]:
        out = self.close_pause(session_id, now_s)
        self._context[session_id] = (program_id, context_tokens)
        return out + self._feed(TurnStarted(program_id, session_id, now_s, context_tokens, workflow))

    def turn_ended(self, program_id: str, session_id: str, now_s: float, context_tokens: int) -> list[HintModel]:
        self._context[session_id] = (program_id, context_tokens)
        return self._feed(TurnEnded(program_id, session_id, now_s, context_tokens))

    def turn_done(self, computed_tokens: int, prefill_s: float, queue_wait_s: float, recomputed_tokens: int) -> None:
        """A finished turn's cost: tokens prefilled and how long that took (its first token less its queue
        wait), how long it queued, and how much of its context it had to recompute."""
        self.prefill.observe(computed_tokens, max(0.0, prefill_s))
        ttl = getattr(self.policy, "ttl", None)
        if recomputed_tokens > 0 and ttl is not None:  # Continuum's T: how long an evicted context queued
            ttl.observe_evicted_queue_delay(max(0.0, queue_wait_s))

    def tool_started(
        self, program_id: str, session_id: str, tool: str, now_s: float, context_tokens: int | None = None,
        workflow: str = "", *, activity: bool = True,
    ) -> list[HintModel]:
        """A pause starts: a tool (``activity``: its return will be reported, ``tool_returned``) or a wait
        the program marked.  ``context_tokens``: None, the session's last known.  A tool beside one of the
        session's still running joins its pause (reported under the first one's name)."""
        if activity:
            n = self._tools_running[session_id] = self._tools_running.get(session_id, 0) + 1
            p = self.pauses.get(session_id)
            if n > 1 and p is not None and p.returned_s is None:
                return []
        out = self.close_pause(session_id, now_s)
        ctx = self._context.get(session_id, (program_id, 0))[1] if context_tokens is None else context_tokens
        self._context[session_id] = (program_id, ctx)
        self.pauses[session_id] = Pause(program_id, tool, now_s)
        return out + self._feed(ToolStarted(program_id, session_id, tool, now_s, ctx, workflow))

    def tool_returned(
        self, program_id: str, session_id: str, tool: str, now_s: float, duration_s: float, *, activity: bool = True
    ) -> list[HintModel]:
        """A tool returned (``duration_s``: its own measure).  Once every tool of the session did, its
        pause waits for the next turn (or the grace period).  With no pause open here (e.g. a restart
        lost its start) the tool's end is reported at once, as measured."""
        n = self._tools_running.get(session_id, 0)
        if activity and n > 0:
            self._tools_running[session_id] = n - 1
            if n > 1:
                return []
        p = self.pauses.get(session_id)
        if p is None:
            return self._feed(ToolEnded(program_id, session_id, tool, now_s, duration_s))
        p.returned_s = now_s
        return []

    def close_pause(self, session_id: str, now_s: float) -> list[HintModel]:
        """End the session's pause now, if one is open (``ToolEnded``).  Its length runs to now, or to the
        tool's return when the grace period ran out first: that idle time is not the tool's."""
        p = self.pauses.pop(session_id, None)
        if p is None:
            return []
        end = now_s
        if p.returned_s is not None and now_s - p.returned_s >= self.tool_grace_s:
            end = p.returned_s
        return self._feed(ToolEnded(p.program_id, session_id, p.tool, now_s, max(0.0, end - p.started_s)))

    def session_finished(self, session_id: str, now_s: float) -> list[HintModel]:
        """The session ran its last turn (a framework that knows it says so; KVFlow is told)."""
        note = getattr(self.policy, "note_agent_finished", None)
        return self._guard("note_agent_finished", lambda: list(note(session_id, now_s))) if note is not None else []

    def program_ended(self, program_id: str, now_s: float, num_turns: int) -> list[HintModel]:
        """Close the program's pauses, tell the policy (``num_turns=0``: not a sample of program length)."""
        out: list[HintModel] = []
        for sid in [sid for sid, p in self.pauses.items() if p.program_id == program_id]:
            out += self.close_pause(sid, now_s)
        out += self._feed(ProgramEnded(program_id, now_s, num_turns))
        self.forget(program_id)
        return out

    def forget(self, program_id: str) -> None:
        """Drop what the core keeps of a program (its pauses are not reported: when they ended is unknown)."""
        for sid in [sid for sid, (pid, _) in self._context.items() if pid == program_id]:
            del self._context[sid]
            self._tools_running.pop(sid, None)
        for sid in [sid for sid, p in self.pauses.items() if p.program_id == program_id]:
            del self.pauses[sid]

    def sweep(self, now_s: float) -> list[HintModel]:
        """End the pauses whose tools returned ``tool_grace_s`` ago with no next turn since."""
        out: list[HintModel] = []
        if math.isfinite(self.tool_grace_s):
            for sid in [s for s, p in self.pauses.items() if p.returned_s is not None
                        and now_s - p.returned_s >= self.tool_grace_s]:  # fmt: skip
                out += self.close_pause(sid, now_s)
        return out

    def tick(self, now_s: float) -> list[HintModel]:
        """``sweep``, then a ``Tick`` for the policy while any pause is open."""
        out = self.sweep(now_s)
        return (out + self._feed(Tick(now_s))) if self.pauses else out

    def context_tokens(self, session_id: str) -> int:
        """The session's context as its last turn left it (0 for a session not seen)."""
        return self._context.get(session_id, ("", 0))[1]

    @property
    def num_paused(self) -> int:
        return len(self.pauses)

    # ---- hints out ----------------------------------------------------------------------------------
    def address(self, hints: Sequence[HintModel]) -> dict[str, list[HintModel]]:
        """``hints`` per node: to the node holding each session (``node_of``), else to every node."""
        nodes = self.nodes

        def node_of(session_id: str) -> str | None:
            a = self.node_of(session_id)
            return a if a in nodes else None

        return hints_by_node(hints, node_of, nodes)

    def _feed(self, event: Any) -> list[HintModel]:
        if self.on_event is not None:
            self.on_event(event)
        hints = self._guard(type(event).__name__, lambda: list(self.policy.on_event(event) or []))
        if self.validate and hints:
            hints = self._valid(hints)
        return self.rewrite(event, hints) if self.rewrite is not None else hints

    def _guard(self, what: str, call: Callable[[], list[HintModel]]) -> list[HintModel]:
        try:
            return call()
        except Exception:  # a policy bug must not stop the loop (a user's activity, a replay, a benchmark)
            self.num_policy_errors += 1
            name = getattr(self.policy, "name", "?")
            if what not in self._logged:
                self._logged.add(what)
                logger.exception("policy %s failed on %s (logged once per event kind; counted)", name, what)
            return []

    def _valid(self, hints: list[HintModel]) -> list[HintModel]:
        """The hints that are ``hints`` models and pass validation afresh (a user's policy may build them
        with ``model_construct`` or return anything at all); the rest are dropped, counted and logged."""
        out: list[HintModel] = []
        for h in hints:
            kind = type(h).__name__
            try:
                if type(h) not in _HINT_TYPES:
                    raise TypeError(f"not a hint: {h!r:.200}")
                out.append(type(h).model_validate(h.model_dump(warnings=False)))
            except Exception as exc:
                try:
                    self.policy.num_invalid_hints += 1
                except Exception:  # a policy object without the counter (or a read-only one)
                    logger.debug("policy has no num_invalid_hints to count in", exc_info=True)
                if self.on_invalid is not None:
                    self.on_invalid(kind)
                level = logging.DEBUG if ("invalid", kind) in self._logged else logging.WARNING
                self._logged.add(("invalid", kind))
                logger.log(
                    level, "policy %s returned an invalid %s, dropped (only the first of each kind is "
                    "logged as a warning): %s", getattr(self.policy, "name", "?"), kind, exc,
                )  # fmt: skip
        return out
