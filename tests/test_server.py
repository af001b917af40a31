"""The engine node over real gRPC on loopback: one torch-executor node per module, driven by EngineClient.

Checks what a client depends on: tokens equal the model's own greedy continuation, cache accounting across
turns, per-hint status codes on a stream that survives bad hints, INVALID_ARGUMENT for bad prompts, cache
state on change, health and reflection, /metrics, and moving a context between nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine_adapter import EngineCore, RunningNode, build_engine, load_engine_config, start_node
from hints import ContextMoveError, EngineClient, Pin, engine_pb2, move_context

MODEL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "max_model_len": 256,
    "block_size": 16,
    "seed": 0,
}
PIN_BUDGET_BLOCKS = 12  # 0.1875 of 64 device blocks


def _core(node_id: str, **model: Any) -> EngineCore:
    cfg = load_engine_config(
        None,
        node_id=node_id,
        num_device_blocks=64,
        num_host_blocks=8,
        pin_budget_fraction=PIN_BUDGET_BLOCKS / 64,
        model={**MODEL, **model},
    )
    return build_engine(cfg)


@pytest_asyncio.fixture(scope="module")
async def node() -> AsyncIterator[RunningNode]:
    running = await start_node(_core("node-a"), "127.0.0.1", 0, metrics_port=0)
    yield running
    await running.stop(grace=0.5)
    running.core.check_invariants()


@pytest_asyncio.fixture(scope="module")
async def client(node: RunningNode) -> AsyncIterator[EngineClient]:
    async with EngineClient(node.address) as c:
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % MODEL["vocab_size"] for i in range(n)]


def _greedy(core: EngineCore, prompt: list[int], n: int) -> list[int]:
    """The continuation a plain full forward pass picks, token by token: the ground truth."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = int(core.executor.reference_logits(seq).argmax())  # type: ignore[attr-defined]
        out.append(tok)
        seq.append(tok)
    return out


async def test_generate_streams_greedy_tokens_and_reuses_cache(
    node: RunningNode, client: EngineClient
) -> None:
    prompt = _prompt(1, 40)
    chunks = [c async for c in client.stream_generate(prompt, 6, session_id="gen", program_id="p-gen")]
    first = chunks[0].result
    assert first is not None and first.num_prompt_tokens == 40 and first.request_id
    assert first.num_cached_tokens == 0 and first.ttft_s > 0
    assert all(c.result is None for c in chunks[1:])
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == _greedy(node.core, prompt, 6)

    second = prompt + tokens + _prompt(2, 5)
    turn2 = await client.generate(second, 4, session_id="gen", program_id="p-gen")
    assert turn2.num_cached_tokens > 0 and turn2.num_recomputed_tokens == 0
    assert turn2.num_prompt_tokens == len(second)
    assert turn2.token_ids == _greedy(node.core, second, 4)


async def test_push_hints_codes_and_stream_survives(client: EngineClient) -> None:
    await client.generate(_prompt(3, 40), 2, session_id="pin-me")
    ack = await client.push_hints([Pin(session_id="pin-me", ttl_s=60)], batch_id=7)
    assert ack.batch_id == 7
    assert ack.results[0].code == "OK" and ack.results[0].pinned_blocks > 0
    stream = client._hints_call

    ack = await client.push_hints([Pin(session_id="no-such-session", ttl_s=5)])
    assert ack.results[0].code == "NOT_FOUND"

    # The pydantic model refuses these, so build the wire form directly, as a buggy sender would.
    bad = engine_pb2.HintBatch(
        batch_id=9,
        hints=[
            engine_pb2.Hint(pin=engine_pb2.Pin(session_id="pin-me", ttl_s=-1.0)),
            engine_pb2.Hint(pin=engine_pb2.Pin(session_id="pin-me", ttl_s=math.nan)),
            engine_pb2.Hint(),
            engine_pb2.Hint(pin=engine_pb2.Pin(session_id="pin-me", ttl_s=60)),
        ],
        sent_unix_s=math.inf,
    )
    ack = await client.push_batch_proto(bad)
    assert [r.code for r in ack.results] == ["INVALID_ARGUMENT"] * 3 + ["OK"]
    assert "ttl_s" in ack.results[0].message

    # A context bigger than the whole pin budget is clamped, and says so.
    await client.generate(_prompt(4, 240), 4, session_id="too-big")
    ack = await client.push_hints([Pin(session_id="too-big", ttl_s=60)])
    big = ack.results[0]
    assert big.code == "OK" and big.clamped and big.pinned_blocks < big.requested_blocks
    assert big.requested_blocks > PIN_BUDGET_BLOCKS and "clamped" in big.message

    ack = await client.push_hints([Pin(session_id="too-big", ttl_s=0), Pin(session_id="pin-me", ttl_s=0)])
    assert [r.code for r in ack.results] == ["OK", "OK"]
    assert client._hints_call is stream, "errors must not have broken the PushHints stream"
    assert (await client.get_cache_state()).pinned_blocks == 0


async def test_hints_meant_for_an_earlier_life_of_the_node_are_refused(node: RunningNode, client: EngineClient) -> None:
    """A batch stamped with another node epoch (the node restarted since it was made) applies nothing."""
    epoch = node.core.node_epoch
    state = await client.get_cache_state()
    assert state.node_epoch == epoch != 0
    await client.generate(_prompt(6, 40), 2, session_id="epoch")
    ack = await client.push_hints([Pin(session_id="epoch", ttl_s=60)] * 2, node_epoch=epoch + 1)
    assert [r.code for r in ack.results] == ["FAILED_PRECONDITION"] * 2 and "restarted" in ack.results[0].message
    assert ack.node_epoch == epoch and (await client.get_cache_state()).pinned_blocks == 0
    for stamp in (epoch, 0):  # its own life, or any
        ack = await client.push_hints([Pin(session_id="epoch", ttl_s=0)], node_epoch=stamp)
        assert ack.results[0].code == "OK"


@pytest.mark.parametrize(
    "prompt",
    [[1, 2, MODEL["vocab_size"]], [], _prompt(5, MODEL["max_model_len"] + 10)],
    ids=["token-outside-vocab", "empty", "longer-than-max-model-len"],
)
async def test_bad_prompt_is_invalid_argument(client: EngineClient, prompt: list[int]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.generate(prompt, 2, session_id="bad")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = await client.generate(_prompt(6, 8), 2, session_id="after-bad")
    assert len(ok.token_ids) == 2


@pytest.mark.parametrize("session_id", ["", "a\x01b", "s" * 300])
async def test_bad_session_id_is_invalid_argument(client: EngineClient, session_id: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.generate([1, 2, 3], 2, session_id=session_id)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session_id" in (info.value.details() or "")
    await client.get_cache_state(include_sessions=True)  # no odd id got in to spoil it


async def test_cancel_aborts_request(node: RunningNode, client: EngineClient) -> None:
    class Slow:  # slows steps down so the request is surely still running when the client leaves
        def on_request_finished(self, req: Any) -> None: ...
        def on_hints(self, hints: Any, results: Any) -> None: ...
        def on_step(self, batch: Any, out: Any) -> None:
            time.sleep(0.01)

    slow = Slow()
    node.core.observers.append(slow)
    labels = {"model_name": node.core.model_name, "finish_reason": "abort"}

    def aborted() -> float:
        return node.metrics.registry.get_sample_value("hintflow_request_success_total", labels) or 0.0

    before = aborted()
    try:
        async with contextlib.aclosing(
            client.stream_generate(_prompt(7, 10), 200, session_id="cancel-me")
        ) as s:
            async for _ in s:
                break  # leaving the stream cancels the call
        for _ in range(200):
            state = await client.get_cache_state()
            if state.num_running == 0 and state.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert state.num_running == 0 and state.num_waiting == 0
        assert aborted() == before + 1
    finally:
        node.core.observers.remove(slow)


async def test_step_failure_is_internal_and_node_keeps_serving(
    node: RunningNode, client: EngineClient
) -> None:
    class Boom:  # an engine bug in the middle of a step
        def on_request_finished(self, req: Any) -> None: ...
        def on_hints(self, hints: Any, results: Any) -> None: ...
        def on_step(self, batch: Any, out: Any) -> None:
            if any(seq.request_id == "boom-req" for seq in batch.seqs):
                node.core.observers.remove(self)
                raise RuntimeError("boom")

    boom = Boom()
    node.core.observers.append(boom)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(_prompt(12, 10), 5, session_id="boom", request_id="boom-req")
        assert info.value.code() == grpc.StatusCode.INTERNAL and "boom" in (info.value.details() or "")
        ok = await client.generate(_prompt(13, 10), 3, session_id="after-boom")
        assert len(ok.token_ids) == 3
        node.core.check_invariants()
    finally:
        if boom in node.core.observers:
            node.core.observers.remove(boom)
        node.core.step_error = None


async def test_watch_cache_state_sends_first_and_on_change(client: EngineClient) -> None:
    watch = client.watch_cache_state(interval_s=30.0)
    first = await asyncio.wait_for(anext(watch), 5)
    assert first.node_id == "node-a" and first.total_blocks == 64 and first.block_size == 16
    gen = asyncio.create_task(client.generate(_prompt(8, 20), 3, session_id="watched"))
    changed = await asyncio.wait_for(anext(watch), 5)  # well before the 30 s interval: sent on change
    assert changed.version > first.version
    await gen
    await watch.aclose()
    state = await client.get_cache_state(include_sessions=True)
    assert any(s.session_id == "watched" and s.state == "parked" for s in state.sessions)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(client.watch_cache_state(interval_s=-1.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_health_and_reflection(node: RunningNode) -> None:
    async with grpc.aio.insecure_channel(node.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "hintflow.v1.EngineNode"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        reply = await call.read()
        call.cancel()
        names = {s.name for s in reply.list_services_response.service}
        assert "hintflow.v1.EngineNode" in names and "grpc.health.v1.Health" in names


async def test_metrics_endpoint(node: RunningNode, client: EngineClient) -> None:
    await client.generate(_prompt(9, 20), 2, session_id="metrics")
    url = f"http://{node.metrics_address}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    label = 'model_name="hintflow-tiny"'
    assert re.search(rf"^hintflow_time_to_first_token_seconds_count{{{label}}} [1-9]", text, re.M)
    assert re.search(rf"^hintflow_pinned_blocks{{{label}}} ", text, re.M)
    assert re.search(rf'^hintflow_prompt_tokens_total{{{label},source="computed"}} [1-9]', text, re.M)
    assert re.search(r'^hintflow_hints_total\{code="NOT_FOUND",kind="pin",', text, re.M)
    assert "hintflow_hint_delivery_latency_seconds_count" in text


async def test_export_import_between_nodes(node: RunningNode, client: EngineClient) -> None:
    prompt = _prompt(10, 50)
    turn1 = await client.generate(prompt, 3, session_id="mig", program_id="p-mig")
    chunks = [c async for c in client.export_context("mig", chunk_bytes=1)]  # one block a chunk
    head = chunks[0].header
    assert head.model_fingerprint and list(head.token_ids)[:50] == prompt and head.num_blocks == len(chunks) - 1
    assert all(c.num_blocks == 1 and c.kv_data and not c.HasField("header") for c in chunks[1:])

    twin = await start_node(_core("node-b"), metrics_port=-1)
    other = await start_node(_core("node-c", seed=1), metrics_port=-1)
    try:
        async with EngineClient(twin.address) as b, EngineClient(other.address) as c:
            # a copy (the source keeps its context), then the turn on both nodes
            moved = await move_context(client, b, "mig", pin_ttl_s=5.0, chunk_bytes=1, drop_source=False)
            assert moved.num_tokens == len(head.token_ids) and moved.num_blocks == head.num_blocks
            assert moved.num_chunks == head.num_blocks and not moved.source_dropped and moved.pinned_blocks
            nxt = prompt + turn1.token_ids + _prompt(11, 4)
            on_b = await b.generate(nxt, 4, session_id="mig", program_id="p-mig")
            on_a = await client.generate(nxt, 4, session_id="mig", program_id="p-mig")
            assert on_b.num_cached_tokens > 0 and on_b.token_ids == on_a.token_ids
            with pytest.raises(ContextMoveError) as failed:  # another model's node refuses the header
                await move_context(client, c, "mig")
            # The node refuses with FAILED_PRECONDITION before acking the header, so the mover has written
            # no chunk into the refusal and sees the node's own code.  Nothing moved.
            assert failed.value.phase == "import"
            assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "mig" not in {r.session_id for r in (await c.get_cache_state(include_sessions=True)).sessions}
            with pytest.raises(ContextMoveError) as failed:
                await move_context(b, client, "never-seen")
            assert failed.value.phase == "export" and failed.value.code == grpc.StatusCode.NOT_FOUND
            free_on_c = (await c.get_cache_state()).free_blocks
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.import_context(_aiter(chunks[1:]))  # no header first
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # (no ack: no chunk written after)
            assert (await c.get_cache_state()).free_blocks == free_on_c
            many = [chunks[0], *chunks[1:] * 20]  # a long stream into a refusal, again and again (the race)
            for _ in range(10):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await c.import_context(_aiter(many))
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await c.get_cache_state()).free_blocks == free_on_c
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await b.import_context(_aiter(chunks[:2]))  # the stream ends early: nothing is committed
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await b.get_cache_state()).free_blocks == twin.core.cache_state().total_blocks - len(
                twin.core.kv.sessions["mig"].block_ids
            )
    finally:
        await twin.stop(0.2)
        await other.stop(0.2)
    twin.core.check_invariants()


async def _aiter(chunks: list[engine_pb2.ContextChunk]) -> AsyncIterator[engine_pb2.ContextChunk]:
    for chunk in chunks:
        yield chunk


async def test_invariants_hold(node: RunningNode) -> None:
    node.core.check_invariants()
    assert node.core.step_error is None


def test_serve_cli_prints_address_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hintflow",
            "engine",
            "serve",
            "--node-id",
            "cli-node",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--num-device-blocks",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert re.fullmatch(
            r"hintflow engine node cli-node serving on 127\.0\.0\.1:\d+ \(metrics off\)\n", line
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
