"""Context moves between two real vLLM nodes (the session's ``shared`` and ``infer`` servers, tiny model):
``ExportContext`` / ``ImportContext`` / ``DropContext`` on the hint service (``_context_moves``).

What could fail: the moved blocks must be found by the destination's own prefix lookup (the hashes it
computes for those tokens), hold the KV the source computed (the continuation matches the source's, and
a zeroed copy does not), the source must let go only after the commit, and a cut import must give every
block back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from test_runtime_moves import _Scripted  # (a routing policy that sends each turn where the test says)
from test_vllm_backend import BS, Node, _prompt, shared_node  # skips this module too where vLLM is missing
from test_vllm_infer import SERVER as INFER

from hints import ContextMoveError, EngineClient, Release, engine_pb2, move_context
from tests.polling import until
from tests.vllm_support import session_server
from workflows import HintRuntime
from workflows._api import LLMInput


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[tuple[Node, Node]]:
    src = shared_node(tmp_path_factory, pytestconfig)
    server = session_server("infer", tmp_path_factory, pytestconfig)
    dst = Node(server.port, INFER.build_kw["hint_port"], str(server.model))
    yield src, dst
    for n in (src, dst):  # the other modules' tests on these servers start from empty pools
        n.hints(*(Release(program_id=f"pmv-{x}") for x in "abcdef"))
    dst.channel.close()


def _move(src: Node, dst: Node, session: str, **kw: Any) -> Any:
    async def go() -> Any:
        a, b = EngineClient(src.hint_address), EngineClient(dst.hint_address)
        try:
            return await move_context(a, b, session, **kw)
        finally:
            await a.close()
            await b.close()

    return asyncio.run(go())


def _import(dst: Node, src: Node, session: str, edit: Any) -> Any:
    """Export ``session`` from ``src`` and import it into ``dst`` with each chunk passed through ``edit``
    (None drops the chunk and ends the stream there)."""

    async def go() -> Any:
        a, b = EngineClient(src.hint_address), EngineClient(dst.hint_address)

        async def chunks() -> AsyncIterator[engine_pb2.ContextChunk]:
            async for msg in a.export_context(session, chunk_bytes=1):  # (one block a chunk)
                out = edit(msg)
                if out is None:
                    return
                yield out

        try:
            return await b.import_context(chunks())
        finally:
            await a.close()
            await b.close()

    return asyncio.run(go())


def _text(node: Node, prompt: list[int], session: str | None = None, program: str | None = None) -> tuple[str, int]:
    out = node.complete(prompt, session, program, max_tokens=8)
    cached = int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return out["choices"][0]["text"], cached


def test_a_context_moves_and_its_next_turn_hits_there_with_the_same_kv(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes
    p = _prompt(41, 3 * BS + 10)
    src.complete(p, "mv-a", "pmv-a")
    q = p + [7]
    want, hit = _text(src, q)  # the source's own continuation, from its cache (no session: "mv-a" stays)
    assert hit == 3 * BS
    move = _move(src, dst, "mv-a", pin_ttl_s=30.0)
    assert (move.num_blocks, move.num_tokens, move.source_dropped) == (3, 3 * BS, True)
    assert move.pinned_blocks == 3 and move.num_bytes > 0
    assert not any(s.session_id == "mv-a" for s in src.state().sessions)  # the source let go
    got, hit = _text(dst, q, "mv-a", "pmv-a")
    assert hit == 3 * BS  # the destination's own lookup found the moved blocks
    assert got == want


def test_a_context_moves_into_a_node_that_publishes_kv_events(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes  # this time into the shared server, which publishes vLLM's KV events
    p = _prompt(46, 2 * BS + 10)
    dst.complete(p, "mv-f", "pmv-f")
    want, _ = _text(dst, p + [7])
    move = _move(dst, src, "mv-f", pin_ttl_s=30.0)
    assert (move.num_blocks, move.source_dropped) == (2, True)
    got, hit = _text(src, p + [7], "mv-f", "pmv-f")
    assert (got, hit) == (want, 2 * BS)


def test_the_comparison_can_fail_a_zeroed_copy_changes_the_continuation(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes
    p = _prompt(42, 3 * BS + 10)
    src.complete(p, "mv-b", "pmv-b")
    q = p + [7]
    want, _ = _text(src, q)

    def zero(msg: engine_pb2.ContextChunk) -> engine_pb2.ContextChunk:
        if msg.HasField("header"):
            msg.header.pin_ttl_s = 30.0
            return msg
        return engine_pb2.ContextChunk(kv_data=bytes(len(msg.kv_data)), num_blocks=msg.num_blocks)

    done = _import(dst, src, "mv-b", zero)
    assert done.num_blocks == 3
    got, hit = _text(dst, q, "mv-b", "pmv-b")
    assert hit == 3 * BS
    assert got != want


def test_a_cut_import_gives_every_block_back_and_the_source_keeps_its_copy(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes
    p = _prompt(43, 3 * BS + 10)
    src.complete(p, "mv-c", "pmv-c")
    free_before = dst.state().free_blocks
    seen = {"kv": 0}

    def cut(msg: engine_pb2.ContextChunk) -> engine_pb2.ContextChunk | None:
        if msg.HasField("header"):
            return msg
        seen["kv"] += 1
        return msg if seen["kv"] == 1 else None  # the stream ends after one of three blocks

    with pytest.raises(grpc.aio.AioRpcError) as e:
        _import(dst, src, "mv-c", cut)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "after 1 of 3 blocks" in (e.value.details() or "")
    assert dst.state().free_blocks == free_before  # nothing held, nothing half-written left findable
    assert not any(s.session_id == "mv-c" and s.device_tokens for s in dst.state().sessions)
    assert src.cached(p + [7], "mv-c", "pmv-c") == 3 * BS  # no drop came: the source still has it all


def test_refusals_name_what_is_wrong(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes
    with pytest.raises(ContextMoveError) as e:
        _move(src, dst, "mv-nobody")
    assert e.value.phase == "export" and e.value.code == grpc.StatusCode.NOT_FOUND
    p = _prompt(44, 2 * BS + 5)
    src.complete(p, "mv-d", "pmv-d")

    async def drop() -> Any:
        c = EngineClient(src.hint_address)
        try:
            return await c.drop_context("mv-d", 2 * BS)
        finally:
            await c.close()

    out = asyncio.run(drop())  # a drop with no export before it frees nothing
    assert not out.dropped and "no export" in out.reason

    def other_model(msg: engine_pb2.ContextChunk) -> engine_pb2.ContextChunk:
        if msg.HasField("header"):
            msg.header.model_fingerprint = "vllm:another-model"
        return msg

    with pytest.raises(grpc.aio.AioRpcError) as r:
        _import(dst, src, "mv-d", other_model)
    assert r.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "another-model" in (r.value.details() or "")
    assert src.cached(p + [7], "mv-d", "pmv-d") == 2 * BS  # refused before the drop: the source keeps it


async def test_the_runtime_takes_a_routed_sessions_context_to_another_vllm_node(nodes: tuple[Node, Node]) -> None:
    src, dst = nodes
    rt = HintRuntime([f"vllm+{n.base}?hints={n.hint_address}" for n in (src, dst)], "hintflow", migrate=True)
    a, b = rt.engines
    script = _Scripted()
    rt.router.policy = script
    await rt.start()
    try:
        await until(lambda: len(rt.router._nodes) == 2, 30.0, "both nodes in the router")
        prompt = _prompt(45, 3 * BS + 10)
        script.target = a
        first = await rt.generate("pmv-e", LLMInput("mv-e", prompt, max_new_tokens=2))
        rt.turn_ended("pmv-e", "mv-e", len(prompt) + 2)
        await until(lambda: rt.router.session_tokens(a, "mv-e") >= 3 * BS, 30.0, "the context in a's state")
        assert rt.mover is not None
        moved = await rt.mover.take_along(a, b, "mv-e", len(prompt) + 2, recompute_s=lambda n: 1.0)
        assert moved and rt.mover.stats.num_moves == 1
        script.target = b
        second = await rt.generate("pmv-e", LLMInput("mv-e", prompt + first.token_ids + [9], max_new_tokens=2))
        assert second.node == b and second.num_cached_tokens == 3 * BS  # b had never seen this context
    finally:
        await rt.stop()
