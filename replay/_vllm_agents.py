"""One agent program against a real vLLM over the OpenAI HTTP API, and the orchestrator's hint pusher.

Why threads and urllib: the main environment has no async HTTP client, a program is a sequential loop
(call, tool pause, call ...), and at tens of programs a thread each is cheap. Each call streams, so time
to first token is the first streamed chunk; the final chunk's ``usage.prompt_tokens_details`` says how many
prompt tokens vLLM found in its prefix cache. What the request carries depends on the mode: always
``session_id`` and ``vllm_xargs.program_id``; in ``infer`` mode also ``tool`` (the tool this turn's answer
will run) and ``is_last_turn`` (a session's last turn while no other session of the program is left),
which is all the engine-side inference gets; in ``orchestrator`` mode the client's own events feed a
:class:`HintPolicy` whose hints go over gRPC ``PushHints``. A program of several sessions runs each on
its own thread once the sessions it waits on (``after``, AND or OR join) have finished.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replay._vllm_workload import BLOCK, AgentProgram, AgentSession

if TYPE_CHECKING:
    from orchestrator import PolicySpec

logger = logging.getLogger(__name__)

__all__ = ["HintPusher", "ProgramResult", "TurnResult", "run_program"]

STATE_READ_S = 1.0
"""How often the pusher reads the node's ``CacheState`` (its host-hit share and prefill backlog; a
``GetCacheState`` call)."""


@dataclass
class TurnResult:
    sent_s: float
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    already_sent_tokens: int  # of this prompt, tokens an earlier turn of the session had sent
    session_id: str = ""  # the request's session_id


@dataclass
class ProgramResult:
    program_id: str
    arrival_s: float
    end_s: float = 0.0
    turns: list[TurnResult] = field(default_factory=list)
    error: str = ""

    @property
    def jct_s(self) -> float:
        return self.end_s - self.arrival_s


class HintPusher:
    """The orchestrator's side of a real-vLLM run: the client's events through a ``ControlCore`` (the live
    runtime's and the replay's loop: pauses, ticks, pricing, a policy's errors), ticking every ``tick_s``,
    its hints pushed over gRPC.

    Events from many program threads go through a queue to one thread, because policies are not
    thread-safe.  ``event`` takes the events the client sees: ``TurnStarted``, ``TurnEnded``,
    ``ToolStarted``, ``ToolEnded`` (the tool returned: the pause runs on to the session's next turn, as
    live), ``ProgramEnded``; ``session_finished`` and ``turn_done`` say what else the core learns from.
    """

    def __init__(self, target: str, policy_name: str | PolicySpec = "hintflow", tick_s: float = 0.05,
                 s_per_token: float = 1.25e-4, host_s_per_token: float | None = None,
                 pool_tokens: float | None = None, thunder_period_s: float | None = None) -> None:
        """``s_per_token``: the node's re-prefill cost (the client cannot see queue waits, so this prior is
        what the core prices with).  ``host_s_per_token``: the node has a host KV tier, whose copy back
        costs this per token.  ``pool_tokens``: the node's device pool.  ``thunder_period_s``: run
        ThunderAgent's pause/restore controller (``orchestrator.ThunderAgent``) at this period: a paused
        session's next turn waits in :meth:`wait_turn` until the controller restores it, and a pause is
        pushed as ``thunder_pause_hints`` (unpinned, first to evict)."""
        import grpc

        from hints import engine_pb2_grpc
        from orchestrator import ControlCore, ThunderAgent

        self.s_per_token = s_per_token
        self.target, self.pool_tokens = target, int(pool_tokens or 0)
        self.thunder = ThunderAgent(thunder_period_s) if thunder_period_s else None
        self._held: dict[str, threading.Event] = {}  # sessions whose next turn ThunderAgent holds
        self._running: dict[str, int] = {}  # session -> the prompt of its turn in flight
        self.node_idle = False  # the node ran and queued nothing at its last CacheState read
        # what the node's host tier gives back (its CacheState, read every STATE_READ_S), as the live
        # runtime reads it from the state stream
        self.host_hit = 1.0
        self.backlog_tokens = 0  # the node's prefill backlog (CacheState), read with its host hits
        self.prefill_share = self.survival = 0.0  # the measured pin price's readings (CacheState)
        self.core = ControlCore(policy_name, nodes=[target], prefill_prior=lambda n: s_per_token * n)
        self.core.node_seen(
            target, host_tier=host_s_per_token is not None, pool_tokens=pool_tokens or 0.0,
            host_hit_fraction=lambda: self.host_hit, reload_s_per_token=host_s_per_token or 0.0,
            prefill_backlog_tokens=lambda: self.backlog_tokens, prefill_share=lambda: self.prefill_share,
            unpinned_survival=lambda: self.survival,
        )  # fmt: skip
        self.channel = grpc.insecure_channel(target)
        self.stub = engine_pb2_grpc.EngineNodeStub(self.channel)
        self.tick_s = tick_s
        self.events: queue.Queue[Any] = queue.Queue()
        self.sent: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._batch = 0
        # The programs' clock: events carry seconds since the run's start (``run_program``'s ``t0``), and
        # ticks must count from the same origin, or the policy sees its ticks ahead of its events.
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hint-pusher", daemon=True)
        self._thread.start()

    @property
    def policy(self) -> Any:
        return self.core.policy

    def event(self, ev: Any) -> None:
        self.events.put(ev)

    def session_finished(self, session_id: str, now_s: float) -> None:
        self.events.put(("finished", session_id, now_s))

    def wait_turn(self, session_id: str, context_tokens: int, timeout_s: float) -> float:
        """Before a session's next turn (not its first): the seconds it was held, 0 unless ThunderAgent
        paused the session, in which case it waits here for the controller's restore."""
        if self.thunder is None:
            return 0.0
        t = time.monotonic()
        ready = threading.Event()
        self.events.put(("ready", session_id, context_tokens, ready))
        if not ready.wait(timeout_s):
            raise TimeoutError(f"ThunderAgent held session {session_id!r} for over {timeout_s:.0f} s")
        return time.monotonic() - t

    def turn_done(self, computed_tokens: int, ttft_s: float, recomputed_tokens: int) -> None:
        """A turn's first token came ``ttft_s`` after it was sent, having prefilled ``computed_tokens`` of
        which ``recomputed_tokens`` an earlier turn had computed (its context was gone).  Its queue wait is
        the time to first token less the prefill at ``s_per_token`` (the client sees no more)."""
        prefill_s = self.s_per_token * computed_tokens
        self.events.put(("done", computed_tokens, prefill_s, max(0.0, ttft_s - prefill_s), recomputed_tokens))

    def _on(self, ev: Any) -> list[Any]:
        """The hints for one queued item (the core counts and logs a policy that raises, and goes on)."""
        from orchestrator import ProgramEnded, ToolEnded, ToolStarted, TurnEnded, TurnStarted

        core = self.core
        out: list[Any] = []
        if isinstance(ev, tuple) and ev[0] == "ready":  # (only with ThunderAgent's controller)
            assert self.thunder is not None
            if self.thunder.hold(ev[1], ev[2]):
                self._held[ev[1]] = ev[3]
            else:
                ev[3].set()
        elif isinstance(ev, tuple) and ev[0] == "finished":
            if self.thunder is not None:
                self.thunder.forget(ev[1])
            out = core.session_finished(ev[1], ev[2])
        elif isinstance(ev, tuple) and ev[0] == "done":
            core.turn_done(*ev[1:])
        elif isinstance(ev, TurnStarted):
            self._running[ev.session_id] = ev.context_tokens
            out = core.turn_started(ev.program_id, ev.session_id, ev.now_s, ev.context_tokens, ev.workflow)
        elif isinstance(ev, TurnEnded):
            self._running.pop(ev.session_id, None)
            out = core.turn_ended(ev.program_id, ev.session_id, ev.now_s, ev.context_tokens)
        elif isinstance(ev, ToolStarted):
            out = core.tool_started(ev.program_id, ev.session_id, ev.tool, ev.now_s, ev.context_tokens, ev.workflow)
        elif isinstance(ev, ToolEnded):
            out = core.tool_returned(ev.program_id, ev.session_id, ev.tool, ev.now_s, ev.duration_s)
        elif isinstance(ev, ProgramEnded):
            out = core.program_ended(ev.program_id, ev.now_s, ev.num_turns)
        return out

    def _control(self, now: float) -> list[Any]:
        """One ThunderAgent period over the node's sessions: the pause hints; restored turns are let go."""
        from orchestrator import thunder_loads, thunder_pause_hints

        assert self.thunder is not None
        running = [(sid, self.target, tokens) for sid, tokens in self._running.items()]
        loads = thunder_loads(running, self.core.pauses, self.core.context_tokens, lambda _sid: self.target, now)
        plan = self.thunder.control(loads, {self.target: self.pool_tokens}, [self.target] if self.node_idle else [])
        for sid, _node in plan.restore:
            held = self._held.pop(sid, None)
            if held is not None:
                held.set()
        return thunder_pause_hints([sid for _node, sid in plan.pause])

    def _run(self) -> None:
        next_tick = next_read = 0.0
        next_control = self.thunder.period_s if self.thunder is not None else math.inf
        while not self._stop.is_set():
            now = time.monotonic() - self.t0
            if now >= next_read:
                self._read_state()
                next_read = now + STATE_READ_S
            hints: list[Any] = []
            try:
                ev = self.events.get(timeout=max(0.0, next_tick - now))
                hints += self._on(ev)
                while True:
                    hints += self._on(self.events.get_nowait())
            except queue.Empty:
                pass
            now = time.monotonic() - self.t0
            if now >= next_tick:
                hints += self.core.tick(now)
                next_tick = now + self.tick_s
            if now >= next_control:
                hints += self._control(now)
                next_control = now + self.thunder.period_s if self.thunder is not None else math.inf
            if self.core.num_policy_errors:  # (counted by the core; reported with the RPC results)
                self.codes["policy-errors"] = self.core.num_policy_errors
            if hints:
                self._push(hints)

    def _read_state(self) -> None:
        from hints import engine_pb2

        try:
            state = self.stub.GetCacheState(engine_pb2.WatchCacheStateRequest(), timeout=2)
            self.host_hit = min(1.0, max(0.0, float(state.host_hit_fraction)))
            self.backlog_tokens = max(0, int(state.prefill_backlog_tokens))
            self.prefill_share = min(1.0, max(0.0, float(state.prefill_share)))
            self.survival = min(1.0, max(0.0, float(state.unpinned_survival)))
            self.node_idle = state.num_running == 0 and state.num_waiting == 0
        except Exception as e:  # keep the last figure: a missed read is not a failed benchmark
            self.codes[f"cache-state:{type(e).__name__}"] += 1

    def _push(self, hints: list[Any]) -> None:
        from hints import HintBatch, ack_from_proto, batch_to_proto

        self._batch += 1
        batch = batch_to_proto(HintBatch(batch_id=self._batch, hints=hints))
        self.sent.update(type(h).__name__ for h in hints)
        try:
            ack = ack_from_proto(next(iter(self.stub.PushHints(iter([batch]), timeout=10))))
            self.codes.update(r.code for r in ack.results)
        except Exception as e:  # a lost batch is a lost hint, not a failed benchmark
            self.codes[f"rpc:{type(e).__name__}"] += len(hints)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.channel.close()


def _stream_completion(base: str, body: dict[str, Any], timeout_s: float) -> tuple[float, dict[str, Any]]:
    """(seconds to the first token, final usage) of one streamed completion."""
    req = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    ttft = -1.0
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft < 0 and chunk.get("choices"):
                ttft = time.monotonic() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft, usage


def _run_session(
    base: str,
    model: str,
    pid: str,
    session: AgentSession,
    sid: str,
    t0: float,
    mode: str,
    pusher: HintPusher | None,
    timeout_s: float,
    record: Callable[[TurnResult], None],
    is_last_program_turn: Callable[[], bool],
) -> None:
    """One session's turns in order (each its whole context so far), with its tools' pauses; raises on error.

    ``sid`` is the request's ``session_id``; ``is_last_program_turn()`` (asked before the session's last
    turn) says whether no other session of the program is left, which is when ``infer`` mode flags it.
    """
    from orchestrator import ToolEnded, ToolStarted, TurnEnded, TurnStarted

    context: list[int] = []

    def now() -> float:
        return time.monotonic() - t0

    for k, turn in enumerate(session.turns):
        already = len(context)
        context.extend(turn.new_tokens)
        xargs: dict[str, Any] = {"program_id": pid}
        if mode == "infer":
            if turn.tool:
                xargs["tool"] = turn.tool
            xargs["is_last_turn"] = k == len(session.turns) - 1 and is_last_program_turn()
        body = {
            "model": model, "prompt": context, "max_tokens": turn.output_tokens, "min_tokens": turn.output_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": sid, "vllm_xargs": xargs,
        }  # fmt: skip
        sent = now()  # the turn is ready: time held by ThunderAgent counts in its time to first token
        held_s = pusher.wait_turn(sid, len(context), timeout_s) if pusher is not None and k > 0 else 0.0
        if pusher is not None:
            pusher.event(TurnStarted(pid, sid, now(), len(context)))
        ttft, usage = _stream_completion(base, body, timeout_s)
        ttft += held_s
        end = now()
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        record(TurnResult(sent, ttft, end - sent, int(usage.get("prompt_tokens", 0)), cached, already, sid))
        if pusher is not None:
            gone = already - cached if already and cached < already - BLOCK else 0  # beyond one partial block
            pusher.turn_done(max(0, len(context) - cached), ttft, gone)
            pusher.event(TurnEnded(pid, sid, end, len(context) + turn.output_tokens))
        if turn.tool is not None:
            if pusher is not None:
                pusher.event(ToolStarted(pid, sid, turn.tool, end, len(context) + turn.output_tokens))
            time.sleep(turn.pause_s)
            if pusher is not None:  # the tool returned; its pause ends at the next turn (ControlCore)
                pusher.event(ToolEnded(pid, sid, turn.tool, now(), turn.pause_s))
    if pusher is not None:
        pusher.session_finished(sid, now())


def run_program(
    base: str,
    model: str,
    prog: AgentProgram,
    t0: float,
    mode: str,
    pusher: HintPusher | None = None,
    timeout_s: float = 600.0,
) -> ProgramResult:
    """Run ``prog`` from ``t0 + arrival_s`` (monotonic clock); ``mode`` is ``plain``, ``infer`` or ``orchestrator``.

    A one-session program runs on this thread, its ``session_id`` the program id. A program of several
    sessions (``AgentProgram.sessions``) runs each on a thread of its own, started when the program arrives
    (no ``after``) or when all (``join="and"``) or the first (``"or"``) of its ``after`` sessions finished;
    its ``session_id`` is ``PROGRAM/SESSION``. The first error ends the program: sessions not yet started
    never start, running ones finish their turns, and the result carries the error.
    """
    from orchestrator import ProgramEnded

    time.sleep(max(0.0, t0 + prog.arrival_s - time.monotonic()))
    res = ProgramResult(prog.program_id, prog.arrival_s)
    sessions = prog.all_sessions
    lock = threading.Condition()
    started: set[str] = set()
    finished: set[str] = set()
    threads: list[threading.Thread] = []

    def record(t: TurnResult) -> None:
        with lock:
            res.turns.append(t)

    def is_last(sid: str) -> Callable[[], bool]:
        def last() -> bool:
            with lock:
                return finished == {s.session_id for s in sessions} - {sid}
        return last

    def run(s: AgentSession) -> None:
        """This session's turns, then the successors it unblocks (``lock`` held by nobody on entry)."""
        rid = prog.program_id if not prog.sessions else f"{prog.program_id}/{s.session_id}"
        try:
            _run_session(base, model, prog.program_id, s, rid, t0, mode, pusher, timeout_s, record,
                         is_last(s.session_id))  # fmt: skip
        except Exception as e:  # one failed program is reported, the run goes on
            msg = f"{type(e).__name__}: {e}"
            with lock:
                if not res.error:
                    res.error = f"session {s.session_id}: {msg}" if prog.sessions else msg
        with lock:
            finished.add(s.session_id)
            if not res.error:
                for nxt in sessions:
                    ready = nxt.join == "or" or all(d in finished for d in nxt.after)
                    if s.session_id in nxt.after and nxt.session_id not in started and ready:
                        start(nxt)
            lock.notify_all()

    def start(s: AgentSession) -> None:  # with ``lock`` held
        started.add(s.session_id)
        th = threading.Thread(target=run, args=(s,), name=f"{prog.program_id}/{s.session_id}", daemon=True)
        threads.append(th)
        th.start()

    if len(sessions) == 1:
        started.add(sessions[0].session_id)
        run(sessions[0])
    else:
        with lock:
            for s in sessions:
                if not s.after:
                    start(s)
            lock.wait_for(lambda: finished == started)
        for th in threads:
            th.join()
    res.turns.sort(key=lambda t: t.sent_s)
    res.end_s = time.monotonic() - t0
    if pusher is not None:
        pusher.event(ProgramEnded(prog.program_id, res.end_s, len(res.turns)))
    return res
