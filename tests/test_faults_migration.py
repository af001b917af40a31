"""Faults while a context moves between two embedded nodes (issue 18, parts 2 and 4), on real parts: torch
nodes over gRPC on loopback, in this process (``start_engine``) where the test reads a node's KV, as
`hintflow engine serve` subprocesses where a node must die (SIGKILL), and a mover subprocess where the
mover must die.

What must hold whatever is cut: the context is never lost (a turn on a node holding it finds every one of
its tokens cached), never counted twice (a node's used blocks are exactly its sessions' blocks), and no
block leaks on either node once the dust settles:

* cut before the import (the mover reads a chunk and gives up): the source keeps it and lets go of its
  export lease (it can be exported again); the destination holds nothing;
* the destination SIGKILLed mid-stream: the source keeps it and lets go of the lease;
* the source SIGKILLed mid-stream: the destination, which reserved every block up front, gives them all
  back and holds no half-made session;
* the mover SIGKILLed after the commit, before ``DropContext``: both nodes hold a usable copy, the
  destination's pin lapses after its TTL, and a drop after a later turn at the source keeps that copy;
* the happy path: several chunks, none over ``chunk_bytes``; byte-identical KV at the destination, every
  token cached there; the source's copy dropped.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from hints import CacheState, ContextMoveError, EngineClient, Release, move_context
from tests.conftest import SMALL_MODEL
from tests.engine_support import spawn_node
from tests.polling import until

BLOCK_SIZE = SMALL_MODEL["block_size"]
BLOCK_NBYTES = (  # layers x K/V x tokens x KV heads x head dim x float32
    SMALL_MODEL["num_layers"] * 2 * BLOCK_SIZE * SMALL_MODEL["num_kv_heads"]
    * (SMALL_MODEL["hidden_size"] // SMALL_MODEL["num_heads"]) * 4
)  # fmt: skip
NUM_DEVICE_BLOCKS = 128
PROMPT_TOKENS = 200  # + 4 output tokens: a context of 203 tokens, 13 blocks
LONG_PROMPT_TOKENS = 1000  # 63 blocks, 252 KiB of KV: four times the window a reader without BDP grants
NO_BDP = [("grpc.http2.bdp_probe", 0)]
"""Channel options of a mover that must see a source die mid-stream: gRPC grows a stream's receive window
with bandwidth probes (BDP) on loopback until a small context arrives whole before the first chunk is
handed on; without them the window stays at 64 KiB, so the source can run only that far ahead."""
_CONNECTION_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


# ---- nodes --------------------------------------------------------------------------------------------
@dataclass
class NodeProcess:
    """`hintflow engine serve` in a subprocess (the same tiny model as ``start_engine``'s nodes)."""

    proc: subprocess.Popen[str]
    address: str

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def _serve(node_id: str, log_dir: Path, timeout_s: float = 60.0) -> NodeProcess:
    model = {f"HINTFLOW_MODEL__{k.upper()}": str(v) for k, v in SMALL_MODEL.items()}  # one fingerprint
    proc, address, _ = await spawn_node(
        node_id, log_dir, num_device_blocks=NUM_DEVICE_BLOCKS, env=model, timeout_s=timeout_s
    )
    return NodeProcess(proc, address)


@pytest_asyncio.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[NodeProcess]]]:
    started: list[NodeProcess] = []

    async def serve(node_id: str) -> NodeProcess:
        node = await _serve(node_id, tmp_path)
        started.append(node)
        return node

    try:
        yield serve
    finally:
        for node in started:
            if node.proc.poll() is None:
                node.kill()


async def _in_process(start_engine: Callable[..., Awaitable[Any]], node_id: str) -> Any:
    return await start_engine(node_id, num_device_blocks=NUM_DEVICE_BLOCKS)


# ---- checks -------------------------------------------------------------------------------------------
async def _context(
    client: EngineClient, session_id: str, seed: int, num_prompt_tokens: int = PROMPT_TOKENS
) -> tuple[list[int], int]:
    """Compute a context on the node: its tokens so far (prompt and output) and how many of them it holds."""
    prompt = [(seed * 37 + i * 11) % SMALL_MODEL["vocab_size"] for i in range(num_prompt_tokens)]
    out = await client.generate(prompt, 4, session_id=session_id, program_id=session_id)
    tokens = prompt + out.token_ids
    return tokens, len(tokens) - 1  # (the last sampled token has no KV yet)


async def _cached(client: EngineClient, session_id: str, tokens: list[int]) -> int:
    """A turn continuing the context on this node: how many of its prompt tokens were found resident."""
    out = await client.generate([*tokens, 1], 1, session_id=session_id, program_id=session_id)
    return out.num_cached_tokens


async def _state(client: EngineClient) -> CacheState:
    """The node's state, after checking its accounting: used blocks are exactly its sessions' blocks (no
    session shares a block here), and nothing runs or waits."""
    st = await client.get_cache_state(include_sessions=True)
    held = sum(math.ceil(s.device_tokens / BLOCK_SIZE) for s in st.sessions)
    assert st.total_blocks - st.free_blocks == held, st
    assert len({s.session_id for s in st.sessions}) == len(st.sessions), st
    assert (st.num_running, st.num_waiting) == (0, 0), st
    return st


def _session(st: CacheState, session_id: str) -> Any:
    return next((s for s in st.sessions if s.session_id == session_id), None)



async def _parked(client: EngineClient, session_id: str, num_tokens: int) -> bool:
    s = _session(await client.get_cache_state(include_sessions=True), session_id)
    return s is not None and s.state == "parked" and s.device_tokens == num_tokens


async def _whole(client: EngineClient) -> bool:
    st = await client.get_cache_state(include_sessions=True)
    return (st.free_blocks, st.pinned_blocks, st.sessions) == (st.total_blocks, 0, [])


async def _release(client: EngineClient, *program_ids: str) -> None:
    ack = await client.push_hints([Release(program_id=p) for p in program_ids])
    assert all(r.code == "OK" for r in ack.results), ack


# ---- the happy path -----------------------------------------------------------------------------------
async def test_a_context_moves_in_bounded_chunks_and_arrives_byte_identical(start_engine: Any) -> None:
    a, b = await _in_process(start_engine, "node-a"), await _in_process(start_engine, "node-b")
    chunk_bytes = 3 * BLOCK_NBYTES + BLOCK_NBYTES // 2  # three whole blocks a chunk
    async with EngineClient(a.address) as ca, EngineClient(b.address) as cb:
        tokens, n = await _context(ca, "s", seed=1)
        with a.core.exclusive():
            kv_at_a = a.core.executor.read_blocks("device", list(a.core.kv.sessions["s"].block_ids))
        sizes: list[int] = []

        async def on_chunk(index: int, num_bytes: int) -> None:
            assert index == len(sizes)
            sizes.append(num_bytes)

        moved = await move_context(ca, cb, "s", pin_ttl_s=30.0, chunk_bytes=chunk_bytes, on_chunk=on_chunk)
        assert (moved.num_tokens, moved.num_blocks) == (n, math.ceil(n / BLOCK_SIZE))
        assert moved.source_dropped and not moved.source_kept_reason
        # never the whole context at once: several chunks, none over chunk_bytes
        assert moved.num_chunks == len(sizes) > 1 and max(sizes) <= chunk_bytes
        assert sum(sizes) == moved.num_bytes == len(kv_at_a) == moved.num_blocks * BLOCK_NBYTES
        with b.core.exclusive():
            kv_at_b = b.core.executor.read_blocks("device", list(b.core.kv.sessions["s"].block_ids))
        assert kv_at_b == kv_at_a

        st_a, st_b = await _state(ca), await _state(cb)
        assert _session(st_a, "s") is None and st_a.free_blocks == st_a.total_blocks  # A let go of it
        at_b = _session(st_b, "s")
        assert at_b.state == "parked" and at_b.device_tokens == n and at_b.pinned and moved.pinned_blocks
        assert await _cached(cb, "s", tokens) == n  # every token of the context, no prefill
        await _release(cb, "s")
        assert await _whole(cb)


# ---- cut before the import ----------------------------------------------------------------------------
async def test_a_mover_giving_up_after_one_chunk_leaves_the_source_holding_it(start_engine: Any) -> None:
    a, b = await _in_process(start_engine, "node-a"), await _in_process(start_engine, "node-b")
    async with EngineClient(a.address) as ca, EngineClient(b.address) as cb:
        tokens, n = await _context(ca, "s", seed=2)
        chunks = ca.export_context("s", chunk_bytes=BLOCK_NBYTES)
        header = await anext(chunks)
        first = await anext(chunks)
        assert list(header.header.token_ids) == tokens[:n] and first.num_blocks == 1
        held = _session(await ca.get_cache_state(include_sessions=True), "s")
        assert held.state == "running" and held.device_tokens == n  # the lease: out of eviction and turns
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ca.generate([*tokens, 1], 1, session_id="s", program_id="s")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being moved" in str(
            refused.value.details()
        )
        await chunks.aclose()  # the mover gives up: the stream is cancelled

        await until(lambda: _parked(ca, "s", n), 10.0, "the source's lease ended")
        await _state(ca)
        assert await _whole(cb)  # nothing ever reached the destination
        a.core.check_invariants()
        # The lease is gone: the context exports again, all of it, and is whole where it lands.
        moved = await move_context(ca, cb, "s", chunk_bytes=BLOCK_NBYTES)
        assert moved.source_dropped and moved.num_tokens == n
        assert await _cached(cb, "s", tokens) == n
        assert await _whole(ca)


async def test_a_mover_that_hangs_mid_stream_is_given_up_after_the_stall_timeout(start_engine: Any) -> None:
    """Hung, not dead (no connection reset tells the node): the destination ends the import once nothing
    has come for ``transfer_stall_s`` and gives its reserved blocks back."""
    a, b = await _in_process(start_engine, "node-a"), await _in_process(start_engine, "node-b")
    b.servicer.transfer_stall_s = 1.0
    async with EngineClient(a.address) as ca, EngineClient(b.address) as cb:
        tokens, n = await _context(ca, "s", seed=6)
        exported = ca.export_context("s", chunk_bytes=BLOCK_NBYTES)
        sent = [await anext(exported), await anext(exported)]  # the header and one chunk
        await exported.aclose()
        hang = asyncio.Event()

        async def chunks_then_hang() -> AsyncIterator[Any]:
            for chunk in sent:
                yield chunk
            await hang.wait()

        importing = asyncio.create_task(cb.import_context(chunks_then_hang()))

        async def reserved() -> bool:
            s = _session(await cb.get_cache_state(include_sessions=True), "s")
            return s is not None and s.state == "running"

        await until(reserved, 5.0, "the destination reserved the context's blocks")
        await until(lambda: _whole(cb), 5.0, "the destination gave its reserved blocks back")
        hang.set()  # the mover wakes up to find the call ended
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(importing, 10)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: _parked(ca, "s", n), 10.0, "the source's lease ended")
        assert await _cached(ca, "s", tokens) == n


# ---- cut mid-stream -----------------------------------------------------------------------------------
async def test_the_destination_killed_mid_stream_the_source_keeps_the_context(
    start_engine: Any, processes: Callable[[str], Awaitable[NodeProcess]]
) -> None:
    a, d = await asyncio.gather(_in_process(start_engine, "node-a"), processes("node-d"))
    async with EngineClient(a.address, options=NO_BDP) as ca, EngineClient(d.address) as cd:
        tokens, n = await _context(ca, "s", seed=3, num_prompt_tokens=LONG_PROMPT_TOKENS)

        async def kill_destination(index: int, num_bytes: int) -> None:
            if index == 2:
                d.kill()

        with pytest.raises(ContextMoveError) as failed:
            await move_context(ca, cd, "s", chunk_bytes=BLOCK_NBYTES, on_chunk=kill_destination)
        # (a write onto the reset connection fails INTERNAL, "Internal error from Core"; a read UNAVAILABLE)
        assert failed.value.phase == "import" and failed.value.code in _CONNECTION_LOST
        assert failed.value.move is None
        await until(lambda: _parked(ca, "s", n), 10.0, "the source's lease ended")
        await _state(ca)
        a.core.check_invariants()
        assert await _cached(ca, "s", tokens) == n
        await _release(ca, "s")
        assert await _whole(ca)


async def test_the_source_killed_mid_stream_the_destination_gives_every_block_back(
    start_engine: Any, processes: Callable[[str], Awaitable[NodeProcess]]
) -> None:
    src, b = await asyncio.gather(processes("node-s"), _in_process(start_engine, "node-b"))
    async with EngineClient(src.address, options=NO_BDP) as cs, EngineClient(b.address) as cb:
        _, n = await _context(cs, "s", seed=4, num_prompt_tokens=LONG_PROMPT_TOKENS)
        num_blocks = math.ceil(n / BLOCK_SIZE)
        seen: list[CacheState] = []

        async def kill_source(index: int, num_bytes: int) -> None:
            if index == 2:
                seen.append(await cb.get_cache_state(include_sessions=True))
                src.kill()

        with pytest.raises(ContextMoveError) as failed:
            await move_context(cs, cb, "s", chunk_bytes=BLOCK_NBYTES, on_chunk=kill_source)
        assert failed.value.phase == "export" and failed.value.code in _CONNECTION_LOST
        # Mid-stream the destination held every block of the context, in a session no turn could use.
        (mid,) = seen
        half_made = _session(mid, "s")
        assert half_made.state == "running" and half_made.device_tokens == 0
        assert mid.total_blocks - mid.free_blocks == num_blocks
        await until(lambda: _whole(cb), 10.0, "the destination gave its reserved blocks back")
        await _state(cb)
        b.core.check_invariants()


# ---- cut after the import, before the drop ------------------------------------------------------------
_MOVER = """
import asyncio, sys
from hints import EngineClient, move_context

async def main() -> None:
    async with EngineClient(sys.argv[1]) as src, EngineClient(sys.argv[2]) as dst:
        moved = await move_context(src, dst, "s", pin_ttl_s=1.0, chunk_bytes=int(sys.argv[3]), drop_source=False)
        print("committed", moved.num_tokens, flush=True)
        await asyncio.sleep(3600)  # where DropContext would go: SIGKILLed here

asyncio.run(main())
"""


async def test_a_mover_killed_after_the_commit_leaves_two_usable_copies(start_engine: Any) -> None:
    a, b = await _in_process(start_engine, "node-a"), await _in_process(start_engine, "node-b")
    async with EngineClient(a.address) as ca, EngineClient(b.address) as cb:
        tokens, n = await _context(ca, "s", seed=5)
        mover = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_MOVER), a.address, b.address, str(2 * BLOCK_NBYTES)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            assert mover.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(mover.stdout.readline), 30)
            assert line == f"committed {n}\n", line
        finally:
            mover.kill()
            mover.wait()
        # Both hold it: the source as it was, the destination pinned for the mover's 1 s.
        at_a, at_b = _session(await _state(ca), "s"), _session(await _state(cb), "s")
        assert (at_a.state, at_a.device_tokens) == ("parked", n) and not at_a.pinned
        assert (at_b.state, at_b.device_tokens, at_b.pinned) == ("parked", n, True)

        async def unpinned() -> bool:
            return not _session(await cb.get_cache_state(include_sessions=True), "s").pinned

        await until(unpinned, 5.0, "the destination's pin lapsed")
        st_b = await _state(cb)
        assert st_b.pinned_blocks == 0 and _session(st_b, "s").device_tokens == n  # evictable, still whole
        # Each copy serves a turn from cache; the source's copy, which a turn has extended since the export,
        # is no longer what was exported, so a late DropContext keeps it.
        assert await _cached(ca, "s", tokens) == n
        assert await _cached(cb, "s", tokens) == n
        kept = await ca.drop_context("s", n)
        assert not kept.dropped and "a turn ran" in kept.reason
        await _state(ca)
        await _state(cb)
        for client in (ca, cb):
            await _release(client, "s")
            assert await _whole(client)
        a.core.check_invariants()
        b.core.check_invariants()
