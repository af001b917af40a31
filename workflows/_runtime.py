"""The worker-side runtime: program events in, hints out to the right nodes; model calls routed and run.

One ``HintRuntime`` per worker process.  It owns

* the hint policy (chosen by name from ``orchestrator.POLICIES``) and a ``Tick`` loop that lets it renew
  or drop pins while tools run;
* a ``Router`` fed by one ``WatchCacheState`` stream per node (reconnected with backoff when a node goes
  away, so a node that comes back is used again);
* one ``HintPublisher`` per node (its own ``PushHints`` stream, reconnects, ages queued hints);
* one client per node for the turns: an ``EngineClient`` (``Generate``) for an embedded node, a
  ``VllmClient`` (vLLM's OpenAI ``/v1/completions``) for a vLLM node.  A call whose node cannot be reached,
  or breaks off mid-call (its process died), runs again from its start on another node within the same
  activity attempt (``num_failovers``); the node is out of the router until its cache state comes again.

The gRPC channels to a node each have a connection of their own (``NODE_CHANNEL_OPTIONS``): gRPC's shared
one per address would reach a node back from an outage only when its own growing backoff ran out.

Nodes are named as ``hints.parse_engine`` reads them: ``HOST:PORT`` for an embedded node, and
``vllm+http://HOST:PORT?hints=HOST:PORT`` for a vLLM node, whose hints and cache state go to its hint
service (``hints=``) exactly as to an embedded node; only its turns take the HTTP path.  The runtime keys
its router, reports and ``LLMResult.node`` by the spec's canonical name.

Hints about a session go to the node holding it (unknown sessions, e.g. model calls that did not go through
our nodes, go to every node; the node answers NOT_FOUND where it has no such session).  ``Release`` goes to
every node.  Times in events are ``time.monotonic()``; hints carry durations, so clocks never mix.

What a policy object of the user's own returns is checked again before it leaves (each hint must be one
of ``hints``' models and pass its validation afresh; the registered policies build theirs validated): a bad one is dropped, counted in ``policy.num_invalid_hints`` and
``hintflow_invalid_hints_total{kind}``, logged once per kind, and never raises into the user's activity.

Programs whose end the workflow never reports (terminated, timed out, or run on a worker that died) are
not kept forever: a tool whose activity returned ends its pause after ``tool_grace_s`` without a next
turn (so pins are no longer renewed), and a program with no event and no activity running here for
``reap_after_s`` (``reap_paused_after_s``, a day, while a declared ``pause()`` is open: a person may take
hours) is reaped: its state is dropped here and in the policy (it gets ``ProgramEnded`` with
``num_turns=0``, so the turn-count estimate does not learn from it), so nothing more is sent for it;
counted in ``hintflow_programs_reaped_total``.  ``Release`` is sent only if Temporal then says the workflow
is closed (terminated, timed out; the plugin gives the runtime its worker's client): this worker sees only
its own activities, and the program may run on another.  Otherwise its leases lapse.  A reaped program that comes
back is tracked afresh.  Parallel tool activities of one session are one pause, until every one returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from hints import (
    CacheState,
    EngineClient,
    EngineSpec,
    GenerateResult,
    HintAck,
    HintModel,
    Pin,
    Release,
    VllmClient,
    VllmError,
    VllmRejected,
    VllmUnreachable,
    parse_engine,
)
from orchestrator import (
    ControlCore,
    HintPolicy,
    NoNodeAvailable,
    PauseModel,
    PrefillEstimator,
    Router,
    RouteRequest,
)
from workflows._api import LLMInput, LLMResult, decode_text
from workflows._context_moves import ContextMover
from workflows._publisher import HintPublisher, StreamHealth, being_cancelled, describe_error, node_client
from workflows._thunder_live import LiveThunder

__all__ = ["EngineUnavailable", "HintRuntime", "InvalidPrompt", "ProgramStats", "turn_client"]

logger = logging.getLogger(__name__)


MAX_PROGRAMS = 10_000  # finished programs (and sessions) whose stats are kept for reports
MAX_EVENTS = 100_000
_ENDED = frozenset({"completed", "failed", "cancelled"})  # the workflow said so (program_end)


def turn_client(spec: str | EngineSpec) -> EngineClient | VllmClient:
    """The client that runs turns on ``spec``'s node: ``Generate`` over gRPC, or vLLM's OpenAI HTTP API."""
    spec = parse_engine(spec)
    return VllmClient(spec.http_base, spec.model) if spec.is_vllm else node_client(spec.hint_address)


class EngineUnavailable(RuntimeError):
    """No engine node could take the call; retryable (the activity retries until a node answers).

    ``unreachable``: no node answered at all (an outage, retried with backoff until one is back), as
    opposed to a node that answered with an error.  The activity reports an outage as a benign failure, so
    the SDK does not log a warning and a traceback at every retry: the runtime logs the node going down
    and coming back once each (``HintRuntime.node_health``)."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class InvalidPrompt(ValueError):
    """The node refused the prompt (out-of-vocabulary id, too long, ...); retrying cannot help."""


@dataclass
class ProgramStats:
    """What ``hintflow run`` reports per program (and summed in total)."""

    num_turns: int = 0
    num_tools: int = 0
    pins_placed: int = 0  # pins with ttl > 0 the node placed on blocks (or on a running turn's, deferred)
    pins_expired: int = 0  # pins whose lease ran out before the session's next turn
    pins_held: int = 0  # pins still live when the session came back
    status: str = "running"  # "completed" | "failed" | "cancelled" | "reaped" (no event for reap_after_s)


@dataclass
class _SessionInfo:
    """What the runtime keeps of a session beside its pause (``ControlCore.pauses``)."""

    program_id: str
    node: str | None = None
    context_tokens: int = 0
    pin_deadline_s: float | None = None  # monotonic, while a pin we placed is live
    pin_node: tuple[str, int] | None = None  # (address, node epoch) of the node that acked that pin
    in_turn: bool = False  # TurnStarted was fed and no TurnEnded yet (a failed attempt is retried)
    failed_attempt: str = ""  # the model call whose attempt failed last: its retry is the same turn
    # The hints the policy returned on this turn's TurnStarted (its Priority), when ``generate`` routes the
    # turn: they go to each node the turn is placed on, not to where its last turn ran (a node that never
    # saw the program would queue the turn as a new program's: behind every other program's turns).
    turn_hints: list[HintModel] = field(default_factory=list)
    turn_hints_counted: bool = False  # placed once: a re-send (failover, queued move) is not counted again


class HintRuntime:
    def __init__(
        self,
        engines: Sequence[str | EngineSpec],
        policy: str | HintPolicy = "hintflow",
        *,
        routing: str = "hintflow",
        prefill_s: Callable[[int, int], float] | None = None,
        prefill_reload_s: Callable[[int], float] | None = None,
        pause_model: PauseModel | None = None,
        tick_s: float = 0.05,
        watch_interval_s: float = 0.5,
        registry: CollectorRegistry | None = None,
        tool_grace_s: float = 5.0,
        reap_after_s: float = 600.0,
        reap_paused_after_s: float = 86400.0,
        migrate: bool = False,
        thunder_period_s: float | None = None,
    ) -> None:
        """``tool_grace_s``: how long after a tool's activity returned the session still counts as in
        that pause when no next turn comes (the next turn may run on another worker, or the program was
        terminated).  ``reap_after_s``: a program with no event, and no activity running on this worker,
        for this long is taken for gone (see the module doc).  ``thunder_period_s``: run ThunderAgent's
        pause/restore controller at this period (``workflows/_thunder_live.py``)."""
        if not engines:
            raise ValueError("HintRuntime needs at least one engine address (host:port)")
        for name, value in (("tool_grace_s", tool_grace_s), ("reap_after_s", reap_after_s),
                            ("reap_paused_after_s", reap_paused_after_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"HintRuntime: {name} must be a finite number > 0, got {value!r}")
        specs = [parse_engine(e) for e in engines]
        self.specs: dict[str, EngineSpec] = {s.name: s for s in specs}  # by name, first kept
        self.engines = list(self.specs)
        # Live ticks arrive late by a few periods on a busy machine: renew leases 5 ticks before they
        # lapse (and never lease for less), so a renewed pin has no gap.  Replay ticks exactly: 0 there.
        kw: dict[str, Any] = {"renew_ahead_s": 5 * tick_s}
        if pause_model is not None:
            kw["pause_model"] = pause_model
        # The loop's rules (pauses, ticks, a policy's errors and bad hints, pricing from the nodes' states,
        # addressing) are the control core's, as in the replay and the vLLM harness; the runtime adds
        # Temporal's side (retries, reaping, pin outcomes) and the I/O.
        self.core = ControlCore(
            policy, nodes=self.engines, node_of=self._node_of, prefill_prior=prefill_reload_s,
            tool_grace_s=tool_grace_s, on_event=self._on_event, on_invalid=self._on_invalid,
            **(kw if isinstance(policy, str) else {}),
        )  # fmt: skip
        self.policy: HintPolicy = self.core.policy
        self.prefill: PrefillEstimator = self.core.prefill
        self.router = Router(prefill_s, policy=routing)
        self.tick_s = tick_s
        self.watch_interval_s = watch_interval_s
        self.tool_grace_s = float(tool_grace_s)
        self.reap_after_s = float(reap_after_s)
        self.reap_paused_after_s = max(float(reap_paused_after_s), self.reap_after_s)
        self._last_event_s: dict[str, float] = {}  # live program -> monotonic time of its last event
        self._running: dict[str, int] = {}  # live program -> its activities running on this worker
        self._next_reap_check_s = 0.0
        self.registry = registry if registry is not None else CollectorRegistry()
        # Reports keep the most recent programs only: a worker runs for weeks.
        self.programs: dict[str, ProgramStats] = {}
        self.sessions: dict[str, _SessionInfo] = {}
        self.events: deque[Any] = deque(maxlen=MAX_EVENTS)  # recent events fed to the policy
        # per session, per turn: was a pin we placed still live when the turn started ("held"), had it
        # lapsed, or gone with a node that died or restarted since ("expired"), or was there none ("none")
        self.pin_outcomes: dict[str, list[str]] = {}
        # Model calls run again on another node because the chosen one could not be reached or broke off
        # mid-call (its process died): each is one failover, within the same activity attempt.
        self.num_failovers = 0
        self._pin_deadline_at_send: dict[tuple[str, str], float] = {}  # (session, reason): two pins may be in flight
        self._m_hints = Counter(
            "hintflow_hints_emitted_total",
            "Hints the policy produced, by kind",
            ["kind"],
            registry=self.registry,
        )
        self._m_events = Counter(
            "hintflow_program_events_total",
            "Program events seen by the runtime",
            ["kind"],
            registry=self.registry,
        )
        self._m_invalid = Counter(
            "hintflow_invalid_hints_total",
            "Hints from the policy dropped before sending because they failed validation, by kind",
            ["kind"],
            registry=self.registry,
        )
        self._m_reaped = Counter(
            "hintflow_programs_reaped_total",
            "Programs released after reap_after_s seconds without an event (their end never reported)",
            registry=self.registry,
        )
        self.publishers: dict[str, HintPublisher] = {}
        self.clients: dict[str, EngineClient | VllmClient] = {}
        # ``migrate``: contexts move between nodes with the turns the router or a queue sends elsewhere
        # (``_context_moves``: a routed session's, a queued turn's to a node with room; vLLM nodes: routed only)
        vllm_hints = {a: spec.hint_address for a, spec in self.specs.items() if spec.is_vllm}
        self.mover = ContextMover(self.router, self.clients, self.registry, vllm_hints=vllm_hints) if migrate else None
        self.thunder = (
            LiveThunder(self.core, self._node_states, self._node_of, self.publish, thunder_period_s)
            if thunder_period_s else None
        )  # fmt: skip
        # per node: its cache-state stream up or down (a node down is taken out of the router)
        self.node_health: dict[str, StreamHealth] = {
            a: StreamHealth(f"engine node {a}: cache-state stream", logger) for a in self.engines
        }
        self._tasks: list[asyncio.Task[None]] = []
        # Set by HintflowPlugin from its worker's client: lets a reap ask Temporal whether the program closed.
        self.temporal_client: Any = None
        self._started = False

    # ---- lifetime -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for addr, spec in self.specs.items():
            pub = HintPublisher(
                spec.hint_address,
                registry=self.registry,
                on_ack=functools.partial(self._on_ack, node=addr),
                on_drop=self._on_drop,
            )
            pub.start()
            self.publishers[addr] = pub
            self.clients[addr] = turn_client(spec)
            self._tasks.append(asyncio.create_task(self._watch(addr), name=f"hintflow-watch-{addr}"))
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="hintflow-tick"))
        if self.thunder is not None:
            self._tasks.append(asyncio.create_task(self._thunder_loop(self.thunder), name="hintflow-thunderagent"))

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Flush queued hints (bounded), then stop every task and channel; safe to call twice."""
        if not self._started:
            return
        self._started = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

        async def flush_and_close(pub: HintPublisher) -> None:
            with contextlib.suppress(Exception):
                await pub.flush(flush_timeout_s)
            await pub.close()

        # All at once: a node that is down would hold the flush of every node after it for the whole bound.
        await asyncio.gather(*(flush_and_close(p) for p in self.publishers.values()))
        for c in self.clients.values():
            await c.close()
        if self.mover is not None:
            await self.mover.close()

    async def __aenter__(self) -> HintRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _watch(self, addr: str) -> None:
        """Keep the router's view of ``addr`` fresh; drop the node while it is unreachable.  Retried with
        backoff while the node is down; logged once when it goes down and once when it is back
        (``StreamHealth``), not at every attempt."""
        backoff_s = 0.1
        health = self.node_health[addr]
        while True:
            client = node_client(self.specs[addr].hint_address)  # a fresh channel: it connects at once
            error = "the stream ended"
            try:
                async for state in client.watch_cache_state(self.watch_interval_s, include_sessions=True):
                    health.ok()
                    self.router.update(addr, state, time.monotonic())
                    publisher = self.publishers.get(addr)
                    if publisher is not None:  # a restarted node: hints queued for its earlier life go
                        publisher.note_node_epoch(state.node_epoch)
                    self.note_node_state(addr, state.host_total_blocks > 0, state.total_blocks * state.block_size,
                                         state.host_hit_fraction, state.prefill_backlog_tokens,
                                         state.prefill_share, state.unpinned_survival)
                    backoff_s = 0.1
            except asyncio.CancelledError:
                if being_cancelled():
                    raise
                error = "CancelledError: the call was cancelled under the stream"  # by gRPC, not us: retry
            except Exception as exc:
                error = describe_error(exc)
            finally:
                self.router.remove(addr)
                await client.close()
            health.failed(error, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    def note_node_state(
        self, addr: str, has_host_tier: bool, pool_tokens: float, host_hit_fraction: float = 1.0,
        prefill_backlog_tokens: int = 0, prefill_share: float = 0.0, unpinned_survival: float = 0.0,
    ) -> None:
        """What ``addr``'s cache state says about pricing pins (``ControlCore.node_seen``): its host tier,
        its pool and what its tier gives back, its prefill share and what it keeps of unpinned contexts; its copy-back cost is the router's measure, read at each
        decision, so a torch node's measured cost, once it has copied anything, takes over the default."""
        self.core.node_seen(
            addr, host_tier=has_host_tier, pool_tokens=float(pool_tokens), host_hit_fraction=host_hit_fraction,
            reload_s_per_token=functools.partial(self.router.host_reload_s, addr),
            prefill_backlog_tokens=prefill_backlog_tokens, prefill_share=prefill_share,
            unpinned_survival=unpinned_survival,
        )  # fmt: skip

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            self.publish(self.core.tick(now))
            try:
                self.sweep(now)
            except Exception:  # bookkeeping must never stop the ticks
                logger.exception("hintflow runtime: sweep failed")

    async def _thunder_loop(self, thunder: LiveThunder) -> None:
        while True:
            await asyncio.sleep(thunder.period_s)
            try:
                thunder.control(time.monotonic())
            except Exception:  # a controller bug must not stop the runtime
                logger.exception("hintflow runtime: thunderagent control failed")

    def _node_states(self) -> list[tuple[str, CacheState]]:
        return [(a, st) for a in self.engines if (st := self.router.node_state(a)) is not None]

    def sweep(self, now: float) -> None:
        """End pauses whose tool returned ``tool_grace_s`` ago without a next turn; reap programs idle for
        ``reap_after_s``.  Called from the tick loop (``now``: ``time.monotonic()``)."""
        self.publish(self.core.sweep(now))
        if now < self._next_reap_check_s:
            return
        self._next_reap_check_s = now + min(1.0, self.reap_after_s / 10)
        paused = {p.program_id for p in self.core.pauses.values() if p.returned_s is None}
        for pid, last in list(self._last_event_s.items()):
            horizon = self.reap_paused_after_s if pid in paused else self.reap_after_s  # a person may take hours
            if now - last >= horizon and not self._running.get(pid, 0):
                self.reap(pid, now)

    def reap(self, program_id: str, now: float | None = None) -> None:
        """Take ``program_id`` for gone here: the policy gets ``ProgramEnded`` (``num_turns=0``: not a
        sample of how long programs run) and its sessions are dropped, so nothing more is sent for it.
        Nothing is released on the nodes: this worker sees only its own activities, and the program may
        be running on another worker; what this worker pinned lapses with its leases."""
        now = time.monotonic() if now is None else now
        p = self._program(program_id)
        logger.info(
            "hintflow runtime: no event from program %s for %.0f s; forgetting it (its leases lapse)",
            program_id, now - self._last_event_s.get(program_id, now),
        )  # fmt: skip
        self._m_reaped.inc()
        p.status = "reaped"
        # A pause still open is not reported: when it ended is unknown, and the pause model must not learn
        # a terminated program's wait as a tool's run time.
        self.core.forget(program_id)
        self.core.program_ended(program_id, now, 0)  # (nothing to send: the program may run elsewhere)
        self._forget(program_id)
        if self.temporal_client is not None and self._started:
            with contextlib.suppress(RuntimeError):  # (no running loop: called outside the worker)
                task = asyncio.get_running_loop().create_task(self._release_if_closed(program_id))
                self._tasks.append(task)
                task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    async def _release_if_closed(self, program_id: str) -> None:
        """After a reap: ``Release`` the program's contexts on every node if Temporal says its workflow is
        closed (terminated, timed out, ...); if it still runs, or Temporal cannot say, leave them."""
        from temporalio.client import WorkflowExecutionStatus

        try:
            desc = await self.temporal_client.get_workflow_handle(program_id).describe()
        except Exception as exc:  # unknown id, no permission, server away: releasing blind is not safe
            logger.info("hintflow runtime: cannot tell whether %s closed (%s); not releasing", program_id, exc)
            return
        p = self.programs.get(program_id)
        if desc.status is None or desc.status == WorkflowExecutionStatus.RUNNING or p is None or p.status != "reaped":
            return
        with contextlib.suppress(ValueError):  # an id no Release can carry: the leases lapse anyway
            self.publish([Release(program_id=program_id)])

    # ---- events -------------------------------------------------------------------------------------
    def _program(self, program_id: str) -> ProgramStats:
        return self.programs.setdefault(program_id, ProgramStats())

    def _live_program(self, program_id: str, now: float) -> ProgramStats:
        """The program a *start* event belongs to: a reaped one that comes back runs on (its stats kept);
        one whose end the workflow reported is a new run under the same workflow id (fresh stats)."""
        p = self.programs.get(program_id)
        if p is None or p.status in _ENDED:
            p = self.programs[program_id] = ProgramStats()
        elif p.status != "running":
            p.status = "running"
        self._last_event_s[program_id] = now
        return p

    def _ended(self, program_id: str, session_id: str) -> bool:
        """An *end* event (a turn or tool that returned) of a session we no longer track, of a program that
        ended or was reaped: the tail of a finished run (e.g. the tool of an OR join's cancelled branch)."""
        p = self.programs.get(program_id)
        return session_id not in self.sessions and p is not None and p.status != "running"

    def _session(self, session_id: str, program_id: str) -> _SessionInfo:
        return self.sessions.setdefault(session_id, _SessionInfo(program_id))

    def _sessions_of(self, program_id: str) -> list[tuple[str, _SessionInfo]]:
        return [(sid, s) for sid, s in self.sessions.items() if s.program_id == program_id]

    def _activity(self, program_id: str, delta: int) -> None:
        n = self._running.get(program_id, 0) + delta
        if n > 0:
            self._running[program_id] = n
        else:
            self._running.pop(program_id, None)

    def program_submitted(self, program_id: str, submitted_unix_s: float) -> None:
        """Date the program from when the client submitted it (program-level FCFS)."""
        p = self.programs.get(program_id)
        if p is None or p.status != "running":
            self.core.program_started(program_id, time.monotonic() - max(0.0, time.time() - submitted_unix_s))
        self._live_program(program_id, time.monotonic())

    def turn_started(
        self,
        program_id: str,
        session_id: str,
        context_tokens: int,
        workflow: str = "",
        call: str = "",
        *,
        routed: bool = False,
    ) -> None:
        """A model-call attempt starts.  ``call`` names the model call (e.g. its activity id): a retry of
        the call whose attempt failed last is the same turn, and the policy is not told again.
        ``routed``: the call goes through :meth:`generate`, which sends the turn's hints to the node it
        picks; otherwise they go where the session's last turn ran."""
        now = time.monotonic()
        p = self._live_program(program_id, now)
        self._activity(program_id, +1)
        s = self._session(session_id, program_id)
        s.context_tokens = context_tokens
        if s.in_turn and call == s.failed_attempt:
            return
        s.in_turn, s.failed_attempt = True, ""
        outcome = "none"
        if s.pin_deadline_s is not None:
            outcome = "expired" if now > s.pin_deadline_s or self._pin_lost(s) else "held"
            if outcome == "expired":
                p.pins_expired += 1
            else:
                p.pins_held += 1
            s.pin_deadline_s, s.pin_node = None, None
        self.pin_outcomes.setdefault(session_id, []).append(outcome)
        hints = self.core.turn_started(program_id, session_id, now, context_tokens, workflow)
        s.turn_hints_counted = False
        if routed:  # held until generate has placed the turn (_place_turn_hints)
            s.turn_hints = hints
        else:
            s.turn_hints = []
            self.publish(hints)

    def _pin_lost(self, s: _SessionInfo) -> bool:
        """The node that acked the session's pin is down, or has restarted since (a new epoch): the pin
        went with that life, whatever its lease said."""
        if s.pin_node is None:
            return False
        addr, epoch = s.pin_node
        health = self.node_health.get(addr)
        now_epoch = self.router.node_epoch(addr)  # None: no state since it went away (then health says down)
        return (health is not None and health.down) or (now_epoch is not None and now_epoch != epoch)

    def turn_ended(self, program_id: str, session_id: str, context_tokens: int | None = None) -> None:
        """A model-call attempt succeeded: one turn."""
        self._activity(program_id, -1)
        if self._ended(program_id, session_id):
            return
        now = time.monotonic()
        self._last_event_s[program_id] = now
        s = self._session(session_id, program_id)
        s.in_turn = False
        self._program(program_id).num_turns += 1
        if context_tokens is not None:
            s.context_tokens = context_tokens
        self.publish(self.core.turn_ended(program_id, session_id, now, s.context_tokens))

    def turn_failed(self, program_id: str, session_id: str, call: str = "") -> None:
        """A model-call attempt failed (Temporal may retry it): no turn counted, no TurnEnded; the session
        stays in its turn for the policy until that call's retry, its next tool or the program's end."""
        self._activity(program_id, -1)
        if not self._ended(program_id, session_id):
            self._last_event_s[program_id] = time.monotonic()
            s = self.sessions.get(session_id)
            if s is not None:
                s.failed_attempt = call

    def tool_started(
        self, program_id: str, session_id: str, tool: str, workflow: str = "", *, activity: bool = True
    ) -> None:
        """A pause starts: a tool's activity (``activity=True``: its end is certain to be reported, and
        the program is not reaped while it runs) or a wait marked by ``pause(...)``.  A tool beside one
        of the session's still running joins its pause (``ControlCore.tool_started``)."""
        now = time.monotonic()
        p = self._live_program(program_id, now)
        if activity:
            self._activity(program_id, +1)
        s = self._session(session_id, program_id)
        s.in_turn = False
        p.num_tools += 1
        self.publish(self.core.tool_started(program_id, session_id, tool, now, s.context_tokens, workflow,
                                            activity=activity))

    def tool_ended(
        self, program_id: str, session_id: str, tool: str, duration_s: float, *, activity: bool = True
    ) -> None:
        """The tool's activity returned.  The pause is reported when the session's next turn (or tool, or
        the program's end) starts: what a pin must cover is the whole time the context sits idle, which
        includes the orchestrator scheduling the next model call, not the tool's run time alone.  If no
        next turn comes within ``tool_grace_s`` (it runs on another worker, or the program was
        terminated), :meth:`sweep` reports the pause then."""
        if activity:
            self._activity(program_id, -1)
        if self._ended(program_id, session_id):
            return
        now = time.monotonic()
        self._last_event_s[program_id] = now
        self._session(session_id, program_id)
        self.publish(self.core.tool_returned(program_id, session_id, tool, now, duration_s, activity=activity))

    def program_ended(self, program_id: str, status: str = "completed") -> None:
        p = self._program(program_id)
        p.status = status
        self.publish(self.core.program_ended(program_id, time.monotonic(), p.num_turns))
        self._forget(program_id)

    def _forget(self, program_id: str) -> None:
        """Drop what the runtime keeps about a program that ended (or was reaped)."""
        gone = {sid for sid, _ in self._sessions_of(program_id)}
        if self.thunder is not None:
            self.thunder.forget(gone)
        for sid in gone:
            del self.sessions[sid]
        for key in [k for k in self._pin_deadline_at_send if k[0] in gone]:
            del self._pin_deadline_at_send[key]
        self._last_event_s.pop(program_id, None)
        self._trim_history()

    def _trim_history(self) -> None:
        finished = [pid for pid, st in self.programs.items() if st.status != "running"]
        for pid in finished[: max(0, len(self.programs) - MAX_PROGRAMS)]:
            del self.programs[pid]
        for sid in list(self.pin_outcomes)[: max(0, len(self.pin_outcomes) - MAX_PROGRAMS)]:
            del self.pin_outcomes[sid]

    def _on_event(self, event: Any) -> None:
        """Every event the core feeds the policy: kept (the recent ones) and counted, ticks aside."""
        kind = type(event).__name__
        if kind != "Tick":
            self.events.append(event)
            self._m_events.labels(kind).inc()

    def _on_invalid(self, kind: str) -> None:
        self._m_invalid.labels(kind).inc()

    # ---- hints out ----------------------------------------------------------------------------------
    def _node_of(self, session_id: str) -> str | None:
        """The node the session's hints go to: where its last turn ran (None: unknown, every node)."""
        s = self.sessions.get(session_id)
        return s.node if s is not None and s.node in self.publishers else None

    def publish(self, hints: Sequence[HintModel], *, count: bool = True) -> list[HintModel]:
        """Send each hint to the node(s) it concerns (``ControlCore.address``: a user policy's hints were
        validated there).  Returns them.  ``count=False``: hints sent before, sent again
        (``hintflow_hints_emitted_total`` counts what the policy produced, once)."""
        hints = list(hints)
        if not hints:
            return hints
        pin_deadlines: dict[tuple[str, str], float] = {}
        for h in hints:
            if count:
                self._m_hints.labels(h.kind).inc()
            if isinstance(h, Pin) and h.ttl_s > 0.0:
                # The node's lease runs from receipt, never before now: now + ttl is a lower bound of its
                # deadline, so "held" in the stats is never claimed for a pin the node let go.
                pin_deadlines[(h.session_id, h.reason)] = time.monotonic() + h.ttl_s
        if not self._started:
            return hints  # a late activity after stop(): nothing to deliver to
        self._pin_deadline_at_send.update(pin_deadlines)
        for addr, batch in self.core.address(hints).items():
            if addr in self.publishers:
                self.publishers[addr].publish(batch)
        return hints

    def _on_drop(self, hints: list[HintModel], reason: str) -> None:
        """The publisher dropped these (lapsed in its queue, or the queue was full): no ack will come."""
        now = time.monotonic()
        for h in hints:
            if not isinstance(h, Pin) or h.ttl_s == 0.0:
                continue
            key = (h.session_id, h.reason)
            deadline = self._pin_deadline_at_send.get(key)
            # A later pin under the same key may be live: keep its deadline unless the queue overflowed.
            if deadline is not None and (deadline <= now or reason != "expired"):
                del self._pin_deadline_at_send[key]

    def _on_ack(self, hints: list[HintModel], ack: HintAck, node: str | None = None) -> None:
        """``node``: the address whose publisher got the ack (a pin it placed goes with that node's life)."""
        now = time.monotonic()
        for r in ack.results:
            if r.index >= len(hints):
                continue
            h = hints[r.index]
            if not isinstance(h, Pin):
                continue
            sent_deadline = self._pin_deadline_at_send.pop((h.session_id, h.reason), now + h.ttl_s)
            s = self.sessions.get(h.session_id)
            if s is None:
                continue
            if h.ttl_s == 0.0:
                # An unpin ends a live pin; a pin that already went with its node's life stays lost (its
                # resume counts it expired), even when the node's next life acknowledges the unpin.
                if not self._pin_lost(s):
                    s.pin_deadline_s, s.pin_node = None, None
            elif r.holds:  # (an OK pin on a context already gone holds nothing: not counted)
                self._program(s.program_id).pins_placed += 1
                s.pin_deadline_s = sent_deadline
                s.pin_node = (node, ack.node_epoch) if node is not None else None

    # ---- model calls --------------------------------------------------------------------------------
    def _place_turn_hints(self, s: _SessionInfo) -> None:
        """The turn's own hints to the node it was just placed on (``s.node``), before its request: a
        Priority that lands after the request still re-sorts the queue at once."""
        if s.turn_hints:
            s.turn_hints = self.publish(s.turn_hints, count=not s.turn_hints_counted)
            s.turn_hints_counted = True

    async def generate(self, program_id: str, inp: LLMInput) -> LLMResult:
        """Route the call, run it on a node; another node is tried when the chosen one is unreachable or its
        stream breaks mid-call (the call runs again from its start there: a failover)."""
        try:
            req = RouteRequest(
                inp.session_id, program_id, len(inp.prompt_token_ids), inp.prefix_key, inp.prefix_tokens
            )
        except (ValueError, TypeError) as exc:  # the call's own arguments: retrying cannot help
            raise InvalidPrompt(str(exc)) from None
        tried: list[str] = []
        last_error = "no node has reported its cache state yet"
        # ThunderAgent holds a paused session's call until its restore, onto the node it names
        restored = await self.thunder.admit(inp.session_id, len(inp.prompt_token_ids)) if self.thunder else None
        while True:
            exclude = list(tried)
            if restored and restored not in tried:  # (the restore's node failed: any node will do)
                exclude += [a for a in self.engines if a != restored]
            try:
                decision = self.router.choose(req, time.monotonic(), exclude=exclude)
            except NoNodeAvailable as exc:
                if not tried:
                    last_error = f"{exc} (none is answering its cache-state stream)"
                raise EngineUnavailable(
                    f"no engine node reachable for session {inp.session_id!r} "
                    f"(configured: {', '.join(self.engines)}; tried: {', '.join(tried) or 'none'}): {last_error}",
                    unreachable=True,
                ) from None
            addr = decision.address
            if tried:  # the call runs again, from its start, on another node
                self.num_failovers += 1
                logger.info("session %s: model call failed over to %s (%s)", inp.session_id, addr, last_error)
            s = self._session(inp.session_id, program_id)
            t0 = time.monotonic()
            moved = False
            if decision.moved_from is not None and not tried and self.mover is not None:
                moved = await self.mover.take_along(
                    decision.moved_from, addr, inp.session_id, len(inp.prompt_token_ids) + inp.max_new_tokens,
                    self.prefill.reload_s,
                )
            if decision.moved_from is not None and not moved and decision.moved_from in self.publishers:
                # The old copy is stale now: let it go rather than hold a pin on it.
                self.publishers[decision.moved_from].publish([Pin(session_id=inp.session_id, ttl_s=0.0)])
            s.node = addr
            self.router.started(addr, req)
            if self.thunder is not None:
                self.thunder.started(inp.session_id, addr, len(inp.prompt_token_ids))
            self._place_turn_hints(s)

            def sent_to(address: str, s: _SessionInfo = s, req: RouteRequest = req) -> None:
                nonlocal addr  # a queued turn moved (or went back) to ``address``: it runs there now
                addr = s.node = address
                self.router.started(address, req)
                self._place_turn_hints(s)

            try:
                res: GenerateResult
                if self.mover is not None:
                    res = await self.mover.run_turn(
                        addr, inp.session_id, program_id, inp.prompt_token_ids, inp.max_new_tokens, sent_to
                    )
                else:
                    res = await self.clients[addr].generate(
                        inp.prompt_token_ids, inp.max_new_tokens, inp.session_id, program_id
                    )
            except VllmRejected as exc:  # HTTP 400 from a vLLM node: the same as INVALID_ARGUMENT
                raise InvalidPrompt(f"node {addr} refused the prompt: {exc.message}") from None
            except VllmUnreachable as exc:  # the same as UNAVAILABLE: try another node
                tried.append(addr)
                self.router.remove(addr)
                last_error = f"{addr}: {exc}"
                continue
            except VllmError as exc:
                raise EngineUnavailable(f"node {addr} failed the call: {exc}") from None
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidPrompt(f"node {addr} refused the prompt: {exc.details()}") from None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    tried.append(addr)
                    self.router.remove(addr)
                    last_error = f"{addr}: {code.name} {exc.details()}"
                    continue
                why = f"{code.name} {exc.details()}"
                if code == grpc.StatusCode.UNIMPLEMENTED:  # e.g. a vLLM node's hint service named as HOST:PORT
                    why += f" (a vLLM node? name it vllm+http://HOST:PORT?hints={addr})"
                raise EngineUnavailable(f"node {addr} failed the call: {why}") from None
            finally:
                self.router.finished(addr, inp.session_id)
                if self.thunder is not None:
                    self.thunder.finished(inp.session_id)
            s.context_tokens = len(inp.prompt_token_ids) + len(res.token_ids)
            prefilled = res.num_prompt_tokens - res.num_cached_tokens - res.num_host_hit_tokens
            self.core.turn_done(prefilled, res.ttft_s - res.queue_wait_s, res.queue_wait_s, res.num_recomputed_tokens)
            return LLMResult(
                token_ids=res.token_ids,
                text=decode_text(res.token_ids),
                node=addr,
                num_prompt_tokens=res.num_prompt_tokens,
                num_cached_tokens=res.num_cached_tokens,
                num_host_hit_tokens=res.num_host_hit_tokens,
                num_recomputed_tokens=res.num_recomputed_tokens,
                queue_wait_s=res.queue_wait_s,
                ttft_s=res.ttft_s,
                latency_s=time.monotonic() - t0,
            )

    # ---- reports ------------------------------------------------------------------------------------
    def totals(self) -> ProgramStats:
        t = ProgramStats(status="")
        for p in self.programs.values():
            t.num_turns += p.num_turns
            t.num_tools += p.num_tools
            t.pins_placed += p.pins_placed
            t.pins_expired += p.pins_expired
            t.pins_held += p.pins_held
        return t
