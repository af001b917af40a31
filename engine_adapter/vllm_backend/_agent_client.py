"""One agent program against a real vLLM over the OpenAI HTTP API, and the orchestrator's hint pusher.

Why threads and urllib: the main environment has no async HTTP client, a program is a sequential loop
(call, tool pause, call ...), and at tens of programs a thread each is cheap. Each call streams, so time
to first token is the first streamed chunk; the final chunk's ``usage.prompt_tokens_details`` says how many
prompt tokens vLLM found in its prefix cache. What the request carries depends on the mode: always
``session_id`` and ``vllm_xargs.program_id``; in ``infer`` mode also ``tool`` (the tool this turn's answer
will run) and ``is_last_turn``, which is all the engine-side inference gets; in ``orchestrator`` mode the
client's own events feed a :class:`HintPolicy` whose hints go over gRPC ``PushHints``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ._agent_workload import AgentProgram

__all__ = ["HintPusher", "ProgramResult", "TurnResult", "run_program"]


@dataclass
class TurnResult:
    sent_s: float
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    already_sent_tokens: int  # of this prompt, tokens an earlier turn of the program had sent


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
    """A policy fed with the client's events on one thread, ticking every ``tick_s``, pushing its hints.

    Events from many program threads go through a queue, because policies are not thread-safe.
    """

    def __init__(self, target: str, policy_name: str = "hintflow", tick_s: float = 0.05,
                 s_per_token: float = 1.25e-4) -> None:
        import grpc

        from hints import engine_pb2_grpc
        from orchestrator._policy import get_policy

        self.policy = get_policy(policy_name, prefill_reload=lambda n: s_per_token * n)
        self.channel = grpc.insecure_channel(target)
        self.stub = engine_pb2_grpc.EngineNodeStub(self.channel)
        self.tick_s = tick_s
        self.events: queue.Queue[Any] = queue.Queue()
        self.sent: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._batch = 0
        self._thread = threading.Thread(target=self._run, name="hint-pusher", daemon=True)
        self._thread.start()

    def event(self, ev: Any) -> None:
        self.events.put(ev)

    def _run(self) -> None:
        from orchestrator._policy import Tick

        t0 = time.monotonic()
        next_tick = 0.0
        while not self._stop.is_set():
            now = time.monotonic() - t0
            hints: list[Any] = []
            try:
                ev = self.events.get(timeout=max(0.0, next_tick - now))
                hints += self.policy.on_event(ev)
                while True:
                    hints += self.policy.on_event(self.events.get_nowait())
            except queue.Empty:
                pass
            now = time.monotonic() - t0
            if now >= next_tick:
                hints += self.policy.on_event(Tick(now_s=now))
                next_tick = now + self.tick_s
            if hints:
                self._push(hints)

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


def run_program(
    base: str,
    model: str,
    prog: AgentProgram,
    t0: float,
    mode: str,
    pusher: HintPusher | None = None,
    timeout_s: float = 600.0,
) -> ProgramResult:
    """Run ``prog`` from ``t0 + arrival_s`` (monotonic clock); ``mode`` is ``plain``, ``infer`` or ``orchestrator``."""
    from orchestrator._policy import ProgramEnded, ToolEnded, ToolStarted, TurnEnded, TurnStarted

    time.sleep(max(0.0, t0 + prog.arrival_s - time.monotonic()))
    res = ProgramResult(prog.program_id, prog.arrival_s)
    pid = sid = prog.program_id
    context: list[int] = []

    def now() -> float:
        return time.monotonic() - t0

    try:
        for k, turn in enumerate(prog.turns):
            already = len(context)
            context.extend(turn.new_tokens)
            xargs: dict[str, Any] = {"program_id": pid}
            if mode == "infer":
                if turn.tool:
                    xargs["tool"] = turn.tool
                xargs["is_last_turn"] = k == len(prog.turns) - 1
            body = {
                "model": model, "prompt": context, "max_tokens": turn.output_tokens, "min_tokens": turn.output_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "session_id": sid, "vllm_xargs": xargs,
            }  # fmt: skip
            sent = now()
            if pusher is not None:
                pusher.event(TurnStarted(pid, sid, sent, len(context)))
            ttft, usage = _stream_completion(base, body, timeout_s)
            end = now()
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            res.turns.append(TurnResult(sent, ttft, end - sent, int(usage.get("prompt_tokens", 0)), cached, already))
            if pusher is not None:
                pusher.event(TurnEnded(pid, sid, end, len(context) + turn.output_tokens))
            if turn.tool is not None:
                if pusher is not None:
                    pusher.event(ToolStarted(pid, sid, turn.tool, end, len(context) + turn.output_tokens))
                time.sleep(turn.pause_s)
                if pusher is not None:
                    pusher.event(ToolEnded(pid, sid, turn.tool, now(), turn.pause_s))
    except Exception as e:  # one failed program is reported, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    res.end_s = now()
    if pusher is not None:
        pusher.event(ProgramEnded(pid, res.end_s, len(res.turns)))
    return res
