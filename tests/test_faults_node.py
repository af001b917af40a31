"""Faults on the engine side, on real parts: an engine node SIGKILLed mid-turn, and a node SIGKILLed and
started again on the same address (a restart: a new, empty life of the node).

Real parts throughout: the session's Temporal dev server (``temporal_env``), two torch engine nodes as
`hintflow engine serve` subprocesses on loopback (so that SIGKILL is a real death), and a worker with
``HintflowPlugin`` in this process, so that its runtime (router, publishers, counters) can be read.

What must hold (issue 18, item 4):

* a node dies mid-turn: the turn runs again on the other node, cold (its context recomputed there); the
  router drops the dead node; the program goes on there and no workflow fails, within seconds, far below
  the activities' timeouts;
* a node restarts: it comes back empty; the router forgets the contexts sessions left on its earlier life
  (a resume is not routed there as warm) and the pins placed there are not counted as held; no hint meant
  for the earlier life is applied to the new one (the publisher drops what it still queued once it hears
  of the new life, and the node refuses whole any batch stamped with the old one); the programs finish,
  and the new node's pool is whole at the end.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.worker import Worker

from hints import CacheState, EngineClient, HintAck, HintModel, Pin
from orchestrator import NoNodeAvailable, RouteDecision, RouteRequest
from tests.engine_support import spawn_node
from tests.polling import free_port, until
from workflows import HintflowPlugin, HintRuntime, LLMResult, ToolResult, llm, pause, tool
from workflows._api import LLM_ACTIVITY
from workflows._publisher import node_client

NUM_BLOCKS = 512  # 16-token blocks: 8,192 tokens a node, room for every program's context at once
LONG_TURN = 1000  # output tokens of the turn a node dies in: a few seconds of decoding on 2 cores
RECOVERY_BOUND_S = 25.0
"""Kill to the last program's end: a turn run again in full on the surviving node, then a tool and a short
turn; far below the 5-minute start-to-close and 10 s heartbeat timeouts an unnoticed death would cost."""


# ---- the program ------------------------------------------------------------------------------------
@dataclass
class ProgramInput:
    prompt_tokens: int
    output_tokens: list[int]  # one model call each
    tool_s: float = 0.1  # a tool between two calls
    wait_for_go: bool = False  # instead: after the first call, wait for the "go" signal (a person)
    seed: int = 0


@workflow.defn(name="faults_node.Program", sandboxed=False)
class Program:
    def __init__(self) -> None:
        self._go = False

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.run
    async def run(self, inp: ProgramInput) -> list[LLMResult]:
        rng = random.Random(inp.seed)  # distinct prompts: no program hits another's blocks
        prompt = [rng.randrange(256) for _ in range(inp.prompt_tokens)]
        out: list[LLMResult] = []
        for i, n in enumerate(inp.output_tokens):
            if i > 0 and inp.wait_for_go:
                async with pause("human"):
                    await workflow.wait_condition(lambda: self._go)
            elif i > 0:
                result: ToolResult = await tool("bash", duration_s=inp.tool_s, output_tokens=16)
                prompt = prompt + result.output_token_ids
            res = await llm(prompt, max_new_tokens=n)
            out.append(res)
            prompt = prompt + res.token_ids
        return out


Handle = WorkflowHandle[Any, list[LLMResult]]


async def _start(client: Client, tq: str, name: str, inp: ProgramInput) -> Handle:
    return await client.start_workflow(Program.run, inp, id=f"{name}-{tq}", task_queue=tq)


async def _results(handles: list[Handle], timeout_s: float) -> dict[str, list[LLMResult]]:
    """Every program's model-call results, by workflow id; each program must complete."""
    results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), timeout_s)
    for h in handles:
        assert (await h.describe()).status == WorkflowExecutionStatus.COMPLETED
    return {h.id: r for h, r in zip(handles, results, strict=True)}


# ---- nodes as processes -----------------------------------------------------------------------------
@dataclass
class NodeProcess:
    """`hintflow engine serve` in a subprocess."""

    proc: subprocess.Popen[str]
    address: str
    log: Path

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    async def state(self) -> CacheState:
        async with EngineClient(self.address) as c:
            return await c.get_cache_state(include_sessions=True)



async def _serve(node_id: str, log_dir: Path, port: int = 0, timeout_s: float = 60.0) -> NodeProcess:
    """Start a torch node (the default tiny model) and wait for its "serving on" line."""
    proc, address, log = await spawn_node(
        node_id, log_dir, num_device_blocks=NUM_BLOCKS, port=port, timeout_s=timeout_s
    )
    return NodeProcess(proc, address, log)


def _kill(*nodes: NodeProcess | None) -> None:
    for n in nodes:
        if n is not None and n.proc.poll() is None:
            n.kill()



async def _whole(node: NodeProcess, timeout_s: float = 10.0) -> None:
    """Wait until the node holds nothing: every block free, nothing pinned, queued or running."""
    last: list[CacheState] = []

    async def empty() -> bool:
        st = await node.state()
        last[:] = [st]
        return (st.free_blocks, st.pinned_blocks, st.num_running, st.num_waiting, len(st.sessions)) == (
            st.total_blocks, 0, 0, 0, 0
        )  # fmt: skip

    try:
        await until(empty, timeout_s, f"node {node.address} whole")
    except AssertionError:
        raise AssertionError(f"node {node.address} not whole: {last}") from None


def _route_alone(rt: HintRuntime, session_id: str, context_tokens: int, address: str) -> RouteDecision:
    """The router's decision for this session's turn with every node but ``address`` excluded."""
    others = [a for a in rt.engines if a != address]
    req = RouteRequest(session_id, session_id, context_tokens)
    return rt.router.choose(req, time.monotonic(), exclude=others)


async def _llm_attempts(handle: Handle) -> list[int]:
    """The attempt number each of the program's model-call activities completed in, from its history."""
    kinds: dict[int, str] = {}
    out: list[int] = []
    async for e in handle.fetch_history_events():
        if e.HasField("activity_task_scheduled_event_attributes"):
            kinds[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        if e.HasField("activity_task_started_event_attributes"):
            a = e.activity_task_started_event_attributes
            if kinds[a.scheduled_event_id] == LLM_ACTIVITY:
                out.append(a.attempt)
    return out


def _in_flight(st: CacheState) -> list[str]:
    return [s.session_id for s in st.sessions if s.state in ("running", "waiting")]


# ---- a node dies mid-turn ---------------------------------------------------------------------------
async def test_a_node_killed_mid_turn_its_turns_rerun_cold_on_the_other(
    temporal_env: Any, tmp_path: Path
) -> None:
    a, b = await asyncio.gather(_serve("node-a", tmp_path), _serve("node-b", tmp_path))
    nodes = {a.address: a, b.address: b}
    try:
        rt = HintRuntime([a.address, b.address], "hintflow")
        client = temporal_env.client
        tq = f"tq-node-dies-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=tq, workflows=[Program], plugins=[HintflowPlugin(runtime=rt)]):
            prompt = 400
            handles = [
                await _start(client, tq, f"mid-turn-{i}", ProgramInput(prompt, [LONG_TURN, 8], seed=i))
                for i in range(3)
            ]
            in_flight: dict[str, list[str]] = {}

            async def deep_in_a_turn() -> bool:
                # A node a fifth of the way into decoding a long turn: kill it there.
                for addr, node in nodes.items():
                    st = await node.state()
                    deep = prompt + LONG_TURN // 5
                    if any(s.state == "running" and s.device_tokens >= deep for s in st.sessions):
                        in_flight[addr] = _in_flight(st)
                        return True
                return False

            await until(deep_in_a_turn, 60, "a node decoding a long turn")
            [(victim_addr, victims)] = in_flight.items()
            victim = nodes[victim_addr]
            survivor = b if victim is a else a
            failovers0 = rt.num_failovers
            victim.kill()
            killed = time.monotonic()

            results = await _results(handles, RECOVERY_BOUND_S + 30)
            took = time.monotonic() - killed
            assert took < RECOVERY_BOUND_S, took
            for sid, (first, second) in results.items():
                assert (len(first.token_ids), len(second.token_ids)) == (LONG_TURN, 8)
                if sid in victims:
                    # The turn ran again on the other node, in full and cold: nothing of it was there.
                    assert first.node == survivor.address, (sid, first.node)
                    assert (first.num_cached_tokens, first.num_host_hit_tokens) == (0, 0), first
                    assert first.num_prompt_tokens == prompt
                # The program went on where its context is now: its next turn hit it there.
                assert second.node == first.node, (sid, first.node, second.node)
                assert second.num_cached_tokens >= first.num_prompt_tokens + LONG_TURN - 16, second

            # The runtime saw the turn's stream break and ran the turn again on the other node at once,
            # once per call the dead node was serving, within the activity's attempt: no Temporal retry
            # (its backoff), no failed attempt in any program's history.
            assert rt.num_failovers - failovers0 == len(victims), (rt.num_failovers, victims)
            assert [await _llm_attempts(h) for h in handles] == [[1, 1]] * len(handles)
            # The router dropped the dead node: with the survivor excluded, there is nothing to choose.
            assert rt.node_health[victim.address].down
            with pytest.raises(NoNodeAvailable):
                _route_alone(rt, "probe", 16, victim.address)
            # The programs' releases reached the survivor: it holds nothing.
            await _whole(survivor)
    finally:
        _kill(a, b)
    print(f"\nnode killed mid-turn: {len(victims)} turn(s) rerun; all done {took:.1f} s after the kill")


# ---- a node restarts --------------------------------------------------------------------------------
class _Spy:
    """What a publisher did with the hints it held: acks (with the hints as sent) and drops (with why)."""

    def __init__(self, rt: HintRuntime, address: str) -> None:
        self.pub = pub = rt.publishers[address]
        self.acks: list[tuple[list[HintModel], HintAck]] = []
        self.drops: list[tuple[list[HintModel], str]] = []
        on_ack, on_drop = pub.on_ack, pub.on_drop

        def ack(hints: list[HintModel], a: HintAck) -> None:
            self.acks.append((hints, a))
            if on_ack is not None:
                on_ack(hints, a)

        def drop(hints: list[HintModel], reason: str) -> None:
            self.drops.append((hints, reason))
            if on_drop is not None:
                on_drop(hints, reason)

        pub.on_ack, pub.on_drop = ack, drop

    def acked(self, reason: str) -> list[str]:
        """Result codes of the acked pins with this reason."""
        return [
            r.code
            for hints, a in self.acks
            for r in a.results
            if r.index < len(hints) and isinstance(h := hints[r.index], Pin) and h.reason == reason
        ]

    def dropped(self, reason: str, why: str) -> int:
        return sum(
            isinstance(h, Pin) and h.reason == reason for hints, w in self.drops if w == why for h in hints
        )

    def refused(self) -> int:
        return sum(r.code == "FAILED_PRECONDITION" for _, a in self.acks for r in a.results)


async def test_a_restarted_node_comes_back_empty_and_gets_no_hint_of_its_earlier_life(
    temporal_env: Any, tmp_path: Path
) -> None:
    port = free_port()
    a, b = await asyncio.gather(_serve("node-a", tmp_path, port), _serve("node-b", tmp_path))
    a2: NodeProcess | None = None
    try:
        rt = HintRuntime([a.address, b.address], "hintflow")
        client = temporal_env.client
        tq = f"tq-node-restarts-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=tq, workflows=[Program], plugins=[HintflowPlugin(runtime=rt)]):
            prompt = 300
            # Started together, first turns long enough to overlap: the router spreads them over both nodes.
            inputs = [ProgramInput(prompt, [48, 300], wait_for_go=True, seed=10 + i) for i in range(4)]
            handles = list(
                await asyncio.gather(*(_start(client, tq, f"restart-{i}", x) for i, x in enumerate(inputs)))
            )
            ids = [h.id for h in handles]

            async def all_waiting() -> bool:  # every first turn done, every program waiting for its person
                return all((p := rt.core.pauses.get(sid)) is not None and p.tool == "human" for sid in ids)

            await until(all_waiting, 60, "every program past its first turn")
            placed = {sid: rt.sessions[sid].node for sid in ids}
            on_a = [sid for sid in ids if placed[sid] == a.address]
            assert on_a and len(on_a) < len(ids), placed  # the router spread them over both nodes
            pub = rt.publishers[a.address]
            old_epoch = pub.node_epoch
            assert old_epoch != 0
            # A minute's pin on each of a's contexts, placed in the node's first life.
            rt.publish([Pin(session_id=sid, ttl_s=60.0, reason="held") for sid in on_a])
            assert await pub.flush(10)
            assert {s.session_id for s in (await a.state()).sessions if s.pinned} >= set(on_a)
            ctx = {sid: rt.sessions[sid].context_tokens for sid in on_a}
            warm = [_route_alone(rt, sid, ctx[sid], a.address).warm_tokens for sid in on_a]
            assert all(w >= ctx[sid] - 16 for w, sid in zip(warm, on_a, strict=True)), warm

            a.kill()

            async def noticed() -> bool:
                return rt.node_health[a.address].down

            await until(noticed, 10, "the runtime noticing the dead node")
            # While it is down the runtime goes on making hints for the contexts it held (renewals; here more
            # than one batch of them): every one meant for the earlier life.
            spy = _Spy(rt, a.address)
            stale = [Pin(session_id=on_a[i % len(on_a)], ttl_s=60.0, reason="while-down") for i in range(300)]
            assert len(stale) > pub.max_batch
            rt.publish(stale)

            a2 = await _serve("node-a", tmp_path, port)  # the same id and address: only its epoch tells
            serving = time.monotonic()

            async def heard() -> bool:
                return pub.node_epoch not in (0, old_epoch) and pub.num_pending == 0

            # 60 s: one push in flight to the dead life may wait out its ack timeout (10 s), then retries back off,
            # before the queue settles. 15 s, 30 s and 60 s each ran out once on the 2-core CI machine: more like a
            # stuck sender than a slow one (one stuck case, a CancelledError from a call gRPC cancelled under the
            # push, killed the sender for good; now a failed push), so a failure says where the publisher stood.
            try:
                await until(heard, 60, "the runtime hearing of the new life and settling what it had queued")
            except AssertionError as e:
                raise AssertionError(
                    f"{e}; publisher: epoch {pub.node_epoch} (old {old_epoch}), {pub.num_pending} pending, "
                    f"{pub.num_sent} sent, {pub.num_failures} failed pushes, {pub.num_sender_restarts} sender "
                    f"restarts, connected {pub.connected}, sender {pub._task!r}"
                ) from None
            heard_s = time.monotonic() - serving
            # It came back empty.
            st = await a2.state()
            assert (st.node_epoch, st.node_id) == (pub.node_epoch, "node-a")
            assert (st.free_blocks, st.pinned_blocks, st.sessions) == (st.total_blocks, 0, []), st
            # No hint meant for the earlier life was applied to the new one: each was dropped once the
            # publisher heard of the new life, or refused whole by the node; at most the one batch in
            # flight then was refused (the publisher drops the rest on that batch's ack).
            codes = spy.acked("while-down")
            assert set(codes) <= {"FAILED_PRECONDITION"}, codes
            assert spy.dropped("while-down", "restarted") + len(codes) == len(stale)
            assert spy.refused() <= pub.max_batch, spy.refused()

            # The router forgot what the sessions left on the earlier life: routed there now, they are cold.
            async def routable() -> bool:
                try:
                    _route_alone(rt, on_a[0], 1, a.address)
                except NoNodeAvailable:
                    return False
                return True

            await until(routable, 10, "the router taking the new life")
            assert [_route_alone(rt, sid, ctx[sid], a.address).warm_tokens for sid in on_a] == [0] * len(on_a)

            decisions: list[tuple[RouteRequest, RouteDecision]] = []
            choose = rt.router.choose

            def spy_choose(req: RouteRequest, now_s: float, exclude: Collection[str] = ()) -> RouteDecision:
                d = choose(req, now_s, exclude)
                decisions.append((req, d))
                return d

            rt.router.choose = spy_choose  # type: ignore[method-assign]
            # The other node's programs resume first, busy there while a's resume: those go to the idle
            # new life, cold, rather than queue behind them.
            on_b = [h for h in handles if h.id not in on_a]
            for h in on_b:
                await h.signal(Program.go)

            async def b_busy() -> bool:
                return len(_in_flight(await b.state())) == len(on_b)

            await until(b_busy, 15, "the other node's programs resuming")
            for h in handles:
                if h.id in on_a:
                    await h.signal(Program.go)
            results = await _results(handles, 60)
            for sid, (first, second) in results.items():
                if sid in on_a:  # its context died with the earlier life: recomputed wherever it went
                    assert (second.num_cached_tokens, second.num_host_hit_tokens) == (0, 0), second
                else:  # the other node's contexts are untouched
                    assert second.node == first.node and second.num_cached_tokens >= prompt, second
            assert all(d.warm_tokens == 0 for r, d in decisions if r.session_id in on_a), decisions
            assert a.address in {results[sid][1].node for sid in on_a}, "the new life was not used"
            # The earlier life's pins did not hold those contexts until their resumes.
            assert [rt.pin_outcomes[sid][-1] for sid in on_a] == ["expired"] * len(on_a), rt.pin_outcomes
            # The programs' releases reached both nodes: their pools are whole.
            await _whole(a2)
            await _whole(b)
    finally:
        _kill(a, a2, b)
    print(f"\nnode restarted: the runtime heard of its new life {heard_s:.2f} s after it served again")


# ---- a node back from an outage ---------------------------------------------------------------------
async def test_a_node_back_from_an_outage_is_reached_when_the_runtime_asks(start_engine: Any) -> None:
    """By default gRPC shares one connection per address among a process's channels, and one reconnect
    backoff that grows while the node is away (1 s, to 120 s): a node back after five minutes was reached
    116 s late, by old and new channels alike.  The runtime's channels (hint stream, cache-state watch,
    turns) have their own: a fresh one reaches a node that is back at once, even while another channel of
    the process to that address is still in its backoff."""
    address = f"127.0.0.1:{free_port()}"
    async with EngineClient(address) as other:  # gRPC's defaults: the shared connection
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await other.get_cache_state()  # the node is away: the shared backoff starts (at least 0.8 s)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await start_engine("node-back", port=int(address.rsplit(":", 1)[1]))
        async with node_client(address) as c:
            st = await c.get_cache_state()
    assert st.node_id == "node-back"
