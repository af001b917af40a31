"""The worker-side runtime: program events in, hints out to the right nodes; model calls routed and run.

One ``HintRuntime`` per worker process.  It owns

* the hint policy (chosen by name from ``orchestrator.POLICIES``) and a ``Tick`` loop that lets it renew
  or drop pins while tools run;
* a ``Router`` fed by one ``WatchCacheState`` stream per node (reconnected with backoff when a node goes
  away, so a node that comes back is used again);
* one ``HintPublisher`` per node (its own ``PushHints`` stream, reconnects, ages queued hints);
* one client per node for the turns: an ``EngineClient`` (``Generate``) for an embedded node, a
  ``VllmClient`` (vLLM's OpenAI ``/v1/completions``) for a vLLM node.

Nodes are named as ``hints.parse_engine`` reads them: ``HOST:PORT`` for an embedded node, and
``vllm+http://HOST:PORT?hints=HOST:PORT`` for a vLLM node, whose hints and cache state go to its hint
service (``hints=``) exactly as to an embedded node; only its turns take the HTTP path.  The runtime keys
its router, reports and ``LLMResult.node`` by the spec's canonical name.

Hints about a session go to the node holding it (unknown sessions, e.g. model calls that did not go through
our nodes, go to every node; the node answers NOT_FOUND where it has no such session).  ``Release`` goes to
every node.  Times in events are ``time.monotonic()``; hints carry durations, so clocks never mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from hints import (
    EngineClient,
    EngineSpec,
    EvictionOrder,
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
    HintPolicy,
    PauseModel,
    ProgramEnded,
    Tick,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
    get_policy,
)
from orchestrator._prefill import PrefillEstimator
from orchestrator._router import NoNodeAvailable, Router, RouteRequest
from workflows._api import LLMInput, LLMResult, decode_text
from workflows._publisher import HintPublisher

__all__ = ["EngineUnavailable", "HintRuntime", "InvalidPrompt", "ProgramStats", "turn_client"]

logger = logging.getLogger(__name__)


MAX_PROGRAMS = 10_000  # finished programs (and sessions) whose stats are kept for reports
MAX_EVENTS = 100_000


def turn_client(spec: str | EngineSpec) -> EngineClient | VllmClient:
    """The client that runs turns on ``spec``'s node: ``Generate`` over gRPC, or vLLM's OpenAI HTTP API."""
    spec = parse_engine(spec)
    return VllmClient(spec.http_base, spec.model) if spec.is_vllm else EngineClient(spec.hint_address)


class EngineUnavailable(RuntimeError):
    """No engine node could take the call; retryable (the activity retries until a node answers)."""


class InvalidPrompt(ValueError):
    """The node refused the prompt (out-of-vocabulary id, too long, ...); retrying cannot help."""


@dataclass
class ProgramStats:
    """What ``hintflow run`` reports per program (and summed in total)."""

    num_turns: int = 0
    num_tools: int = 0
    pins_placed: int = 0  # pins with ttl > 0 the node accepted
    pins_expired: int = 0  # pins whose lease ran out before the session's next turn
    pins_held: int = 0  # pins still live when the session came back
    status: str = "running"


@dataclass
class _SessionInfo:
    program_id: str
    node: str | None = None
    context_tokens: int = 0
    pin_deadline_s: float | None = None  # monotonic, while a pin we placed is live
    tool: str | None = None  # the pause in progress (tool started, next turn not yet)
    tool_started_s: float = 0.0
    tool_done: bool = False  # its activity returned; the context waits for the next turn


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
    ) -> None:
        if not engines:
            raise ValueError("HintRuntime needs at least one engine address (host:port)")
        specs = [parse_engine(e) for e in engines]
        self.specs: dict[str, EngineSpec] = {s.name: s for s in specs}  # by name, first kept
        self.engines = list(self.specs)
        self.prefill = PrefillEstimator(prefill_reload_s)
        # Live ticks arrive late by a few periods on a busy machine: renew leases 5 ticks before they
        # lapse (and never lease for less), so a renewed pin has no gap.  Replay ticks exactly: 0 there.
        kw: dict[str, Any] = {"prefill_reload": self.prefill.reload_s, "renew_ahead_s": 5 * tick_s}
        if pause_model is not None:
            kw["pause_model"] = pause_model
        self.policy: HintPolicy = get_policy(policy, **kw) if isinstance(policy, str) else policy
        self.router = Router(prefill_s, policy=routing)
        # engine -> whether its last CacheState showed a host tier; a policy built here by name learns
        # from it how a lost context comes back (a policy object passed in is left as configured)
        self._host_tier: dict[str, bool] = {}
        self._auto_host_reload = isinstance(policy, str)
        self.tick_s = tick_s
        self.watch_interval_s = watch_interval_s
        self.registry = registry if registry is not None else CollectorRegistry()
        # Reports keep the most recent programs only: a worker runs for weeks.
        self.programs: dict[str, ProgramStats] = {}
        self.sessions: dict[str, _SessionInfo] = {}
        self.events: deque[Any] = deque(maxlen=MAX_EVENTS)  # recent events fed to the policy
        # per session, per turn: was a pin we placed still live when the turn started ("held"), had it
        # lapsed ("expired"), or was there none ("none")
        self.pin_outcomes: dict[str, list[str]] = {}
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
        self.publishers: dict[str, HintPublisher] = {}
        self.clients: dict[str, EngineClient | VllmClient] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    # ---- lifetime -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for addr, spec in self.specs.items():
            pub = HintPublisher(spec.hint_address, registry=self.registry, on_ack=self._on_ack)
            pub.start()
            self.publishers[addr] = pub
            self.clients[addr] = turn_client(spec)
            self._tasks.append(asyncio.create_task(self._watch(addr), name=f"hintflow-watch-{addr}"))
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="hintflow-tick"))

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
        for pub in self.publishers.values():
            with contextlib.suppress(Exception):
                await pub.flush(flush_timeout_s)
            await pub.close()
        for c in self.clients.values():
            await c.close()

    async def __aenter__(self) -> HintRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _watch(self, addr: str) -> None:
        """Keep the router's view of ``addr`` fresh; drop the node while it is unreachable."""
        backoff_s = 0.1
        while True:
            client = EngineClient(self.specs[addr].hint_address)
            try:
                async for state in client.watch_cache_state(self.watch_interval_s, include_sessions=True):
                    self.router.update(addr, state, time.monotonic())
                    self.note_host_tier(addr, state.host_total_blocks > 0)
                    backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.info("cache-state stream from %s failed (%s); retrying in %.1fs", addr, exc, backoff_s)
            finally:
                self.router.remove(addr)
                await client.close()
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    def note_host_tier(self, addr: str, has_host_tier: bool) -> None:
        """Pins are priced by the copy back from the host only when every engine has a host tier: on a
        node without one a pin saves a re-prefill, and the policy does not know which node a session is on."""
        if not self._auto_host_reload or self._host_tier.get(addr) == has_host_tier:
            return
        self._host_tier[addr] = has_host_tier
        every = set(self._host_tier) >= set(self.engines) and all(self._host_tier.values())
        set_host_reload = getattr(self.policy, "set_host_reload", None)
        if set_host_reload is None or every == (getattr(self.policy, "host_reload", None) is not None):
            return
        router, engines = self.router, list(self.engines)

        def copy_back_s(n: int) -> float:
            # the slowest node's copy (the policy does not know where a session is), read at each decision
            # so that a torch node's measured cost, once it has copied anything, takes over the default
            return n * max(router.host_reload_s(a) for a in engines)

        set_host_reload(copy_back_s if every else None)
        logger.info("host tier on every engine: %s; pins priced by %s", every, "the copy back" if every else "re-prefill")

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self._feed(Tick(time.monotonic()))

    # ---- events -------------------------------------------------------------------------------------
    def _program(self, program_id: str) -> ProgramStats:
        return self.programs.setdefault(program_id, ProgramStats())

    def _session(self, session_id: str, program_id: str) -> _SessionInfo:
        return self.sessions.setdefault(session_id, _SessionInfo(program_id))

    def program_submitted(self, program_id: str, submitted_unix_s: float) -> None:
        """Date the program from when the client submitted it (program-level FCFS)."""
        note = getattr(self.policy, "note_program_start", None)
        if note is not None and program_id not in self.programs:
            note(program_id, time.monotonic() - max(0.0, time.time() - submitted_unix_s))
        self._program(program_id)

    def turn_started(self, program_id: str, session_id: str, context_tokens: int, workflow: str = "") -> None:
        now = time.monotonic()
        s = self._session(session_id, program_id)
        p = self._program(program_id)
        p.num_turns += 1
        outcome = "none"
        if s.pin_deadline_s is not None:
            outcome = "expired" if now > s.pin_deadline_s else "held"
            if outcome == "expired":
                p.pins_expired += 1
            else:
                p.pins_held += 1
            s.pin_deadline_s = None
        self.pin_outcomes.setdefault(session_id, []).append(outcome)
        s.context_tokens = context_tokens
        self._close_pause(s, session_id)
        self._feed(TurnStarted(program_id, session_id, now, context_tokens, workflow))

    def turn_ended(self, program_id: str, session_id: str, context_tokens: int | None = None) -> None:
        s = self._session(session_id, program_id)
        if context_tokens is not None:
            s.context_tokens = context_tokens
        self._feed(TurnEnded(program_id, session_id, time.monotonic(), s.context_tokens))

    def tool_started(self, program_id: str, session_id: str, tool: str, workflow: str = "") -> None:
        s = self._session(session_id, program_id)
        self._close_pause(s, session_id)
        self._program(program_id).num_tools += 1
        now = time.monotonic()
        s.tool, s.tool_started_s, s.tool_done = tool, now, False
        self._feed(ToolStarted(program_id, session_id, tool, now, s.context_tokens, workflow))

    def tool_ended(self, program_id: str, session_id: str, tool: str, duration_s: float) -> None:
        """The tool's activity returned.  The pause is reported when the session's next turn (or tool, or
        the program's end) starts: what a pin must cover is the whole time the context sits idle, which
        includes the orchestrator scheduling the next model call, not the tool's run time alone."""
        s = self._session(session_id, program_id)
        if s.tool is None:  # no start seen (e.g. a runtime restart): report what the activity measured
            self._feed(ToolEnded(program_id, session_id, tool, time.monotonic(), duration_s))
            return
        s.tool_done = True

    def _close_pause(self, s: _SessionInfo, session_id: str) -> None:
        if s.tool is None:
            return
        now = time.monotonic()
        tool, started = s.tool, s.tool_started_s
        s.tool = None
        self._feed(ToolEnded(s.program_id, session_id, tool, now, max(0.0, now - started)))

    def program_ended(self, program_id: str, status: str = "completed") -> None:
        p = self._program(program_id)
        p.status = status
        for sid, s in self.sessions.items():
            if s.program_id == program_id:
                self._close_pause(s, sid)
        self._feed(ProgramEnded(program_id, time.monotonic(), p.num_turns))
        for sid in [sid for sid, s in self.sessions.items() if s.program_id == program_id]:
            del self.sessions[sid]
        self._trim_history()

    def _trim_history(self) -> None:
        finished = [pid for pid, st in self.programs.items() if st.status != "running"]
        for pid in finished[: max(0, len(self.programs) - MAX_PROGRAMS)]:
            del self.programs[pid]
        for sid in list(self.pin_outcomes)[: max(0, len(self.pin_outcomes) - MAX_PROGRAMS)]:
            del self.pin_outcomes[sid]

    def _feed(self, event: Any) -> None:
        kind = type(event).__name__
        if kind != "Tick":
            self.events.append(event)
            self._m_events.labels(kind).inc()
        try:
            hints = self.policy.on_event(event)
        except Exception:  # a policy bug must not fail the user's activity
            logger.exception("policy %s failed on %s", self.policy.name, kind)
            return
        if hints:
            self.publish(hints)

    # ---- hints out ----------------------------------------------------------------------------------
    def _nodes_for(self, session_id: str) -> list[str]:
        s = self.sessions.get(session_id)
        return [s.node] if s is not None and s.node in self.publishers else list(self.publishers)

    def publish(self, hints: Sequence[HintModel]) -> None:
        """Send each hint to the node(s) it concerns; validated hints only (the policy built them)."""
        per_node: dict[str, list[HintModel]] = defaultdict(list)
        for h in hints:
            self._m_hints.labels(h.kind).inc()
            if isinstance(h, Release):
                for addr in self.publishers:
                    per_node[addr].append(h)
            elif isinstance(h, EvictionOrder):
                split: dict[str, list[Any]] = defaultdict(list)
                for e in h.entries:
                    for addr in self._nodes_for(e.session_id):
                        split[addr].append(e)
                for addr, entries in split.items():
                    per_node[addr].append(EvictionOrder(entries=entries))
            else:
                sid = getattr(h, "session_id", "")
                if isinstance(h, Pin) and h.ttl_s > 0.0:
                    # The node's lease runs from receipt, never before now: now + ttl is a lower bound of
                    # its deadline, so "held" in the stats is never claimed for a pin the node let go.
                    self._pin_deadline_at_send[(sid, h.reason)] = time.monotonic() + h.ttl_s
                for addr in self._nodes_for(sid):
                    per_node[addr].append(h)
        if not self._started:
            return  # a late activity after stop(): nothing to deliver to
        for addr, batch in per_node.items():
            self.publishers[addr].publish(batch)

    def _on_ack(self, hints: list[HintModel], ack: HintAck) -> None:
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
                s.pin_deadline_s = None
            elif r.ok:
                self._program(s.program_id).pins_placed += 1
                s.pin_deadline_s = sent_deadline

    # ---- model calls --------------------------------------------------------------------------------
    async def generate(self, program_id: str, inp: LLMInput) -> LLMResult:
        """Route the call, run it on a node; another node is tried when the chosen one is unreachable."""
        req = RouteRequest(
            inp.session_id, program_id, len(inp.prompt_token_ids), inp.prefix_key, inp.prefix_tokens
        )
        tried: list[str] = []
        last_error = "no node has reported its cache state yet"
        while True:
            try:
                decision = self.router.choose(req, time.monotonic(), exclude=tried)
            except NoNodeAvailable as exc:
                if not tried:
                    last_error = f"{exc} (none is answering its cache-state stream)"
                raise EngineUnavailable(
                    f"no engine node reachable for session {inp.session_id!r} "
                    f"(configured: {', '.join(self.engines)}; tried: {', '.join(tried) or 'none'}): {last_error}"
                ) from None
            addr = decision.address
            s = self._session(inp.session_id, program_id)
            if decision.moved_from is not None and decision.moved_from in self.publishers:
                # The old copy is stale now: let it go rather than hold a pin on it.
                self.publishers[decision.moved_from].publish([Pin(session_id=inp.session_id, ttl_s=0.0)])
            s.node = addr
            self.router.started(addr, req)
            t0 = time.monotonic()
            try:
                res: GenerateResult = await self.clients[addr].generate(
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
            s.context_tokens = len(inp.prompt_token_ids) + len(res.token_ids)
            prefilled = res.num_prompt_tokens - res.num_cached_tokens - res.num_host_hit_tokens
            self.prefill.observe(prefilled, res.ttft_s - res.queue_wait_s)
            if res.num_recomputed_tokens > 0:
                # Continuum's T: how long a turn whose context had been evicted waited in the queue.
                ttl = getattr(self.policy, "ttl", None)
                if ttl is not None:
                    ttl.observe_evicted_queue_delay(max(0.0, res.queue_wait_s))
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
