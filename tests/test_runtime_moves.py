"""The live runtime takes a session's context along when its router sends the session's turn to another
embedded node (``HintRuntime(migrate=True)``, ``workflows/_context_moves.py``).

Real parts: two torch engine nodes on loopback gRPC, the runtime's own watch streams and clients.  Where the
router sends a turn is forced by a routing policy of the test's own (a registered extension point: the
router's mechanism prices, a small policy object picks), so the move happens on the turn we choose.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from hints import EngineClient, Pin, Priority, Release
from orchestrator import NodeView, RouteRequest
from tests.polling import until
from workflows import HintRuntime
from workflows._api import LLMInput

PROGRAM = "prog-moves"


class _Scripted:
    """Sends every turn to ``target`` (set by the test between turns)."""

    name = "scripted"

    def __init__(self) -> None:
        self.target = ""

    def pick(self, req: RouteRequest, nodes: Sequence[NodeView], home: str | None) -> tuple[NodeView, str]:
        return next(v for v in nodes if v.address == self.target), "scripted"



async def _session_on(address: str, session_id: str) -> int:
    """Tokens (device + host) of the session's context the node reports now; 0 when it holds none."""
    async with EngineClient(address) as c:
        st = await c.get_cache_state(include_sessions=True)
    return sum(r.device_tokens + r.host_tokens for r in st.sessions if r.session_id == session_id)


async def _whole(address: str) -> None:
    """Release the program there and wait until every device block is free and nothing is pinned."""
    async with EngineClient(address) as c:
        await c.push_hints([Release(program_id=PROGRAM)])

        async def empty() -> bool:
            st = await c.get_cache_state(include_sessions=True)
            return st.free_blocks == st.total_blocks and not st.pinned_blocks and not st.sessions

        await until(empty, 10.0, f"node {address} whole")


async def _scripted_runtime(start_engine: Any, migrate: bool) -> tuple[HintRuntime, Any, Any, _Scripted]:
    """Two nodes a and b, and a started runtime whose router sends each turn where the script says."""
    a = await start_engine("a", num_device_blocks=96)
    b = await start_engine("b", num_device_blocks=96)
    rt = HintRuntime([a.address, b.address], "hintflow", migrate=migrate)
    script = _Scripted()
    rt.router.policy = script
    await rt.start()
    await until(lambda: len(rt.router._nodes) == 2, 10.0, "both nodes in the router")
    return rt, a, b, script


async def _two_turns(start_engine: Any, migrate: bool) -> tuple[HintRuntime, Any, Any, list[Any]]:
    rt, a, b, script = await _scripted_runtime(start_engine, migrate)
    prompt = [(7 * i) % 200 + 1 for i in range(400)]
    script.target = a.address
    first = await rt.generate(PROGRAM, LLMInput("s1", prompt, max_new_tokens=4))
    rt.turn_ended(PROGRAM, "s1", len(prompt) + len(first.token_ids))
    await until(lambda: _session_on(a.address, "s1"), 5.0, "the context parked on a")
    script.target = b.address
    second = await rt.generate(PROGRAM, LLMInput("s1", prompt + first.token_ids + [5] * 16, max_new_tokens=4))
    return rt, a, b, [first, second]


async def test_a_moved_session_takes_its_context_along_and_hits_there(start_engine: Any) -> None:
    rt, a, b, (first, second) = await _two_turns(start_engine, migrate=True)
    try:
        assert first.node == a.address and second.node == b.address
        assert rt.mover is not None
        st = rt.mover.stats
        assert (st.num_moves, st.num_failed) == (1, 0)
        assert rt.mover.planner.num_in_flight == 0  # the move's promise on b ended with it
        assert st.num_tokens >= 400 and st.num_bytes > 0 and st.move_s > 0
        # The context arrived whole: every token of the first turn's context hits on b (but the last
        # generated one, whose KV the second turn writes).
        assert second.num_cached_tokens >= 400
        assert second.num_recomputed_tokens == 0
        async def gone_from_a() -> bool:
            return await _session_on(a.address, "s1") == 0

        await until(gone_from_a, 5.0, "a let go of its copy")
    finally:
        await rt.stop()
    await _whole(a.address)
    await _whole(b.address)


async def test_without_moves_the_moved_session_recomputes(start_engine: Any) -> None:
    rt, a, b, (_first, second) = await _two_turns(start_engine, migrate=False)
    try:
        assert rt.mover is None
        assert second.node == b.address
        assert second.num_cached_tokens < 400  # b never saw the context (a shared block at most)
    finally:
        await rt.stop()
    await _whole(a.address)
    await _whole(b.address)


@pytest.mark.parametrize("why", ["no room there", "destination down"])
async def test_a_failed_move_leaves_the_context_usable_at_its_source(start_engine: Any, why: str) -> None:
    a = await start_engine("a", num_device_blocks=96)
    b = await start_engine("b", num_device_blocks=8 if why == "no room there" else 96)
    rt = HintRuntime([a.address, b.address], "hintflow", migrate=True)
    script = _Scripted()
    rt.router.policy = script
    await rt.start()
    try:
        await until(lambda: len(rt.router._nodes) == 2, 10.0, "both nodes in the router")
        prompt = [(3 * i) % 200 + 1 for i in range(300)]
        script.target = a.address
        first = await rt.generate(PROGRAM, LLMInput("s2", prompt, max_new_tokens=2))
        rt.turn_ended(PROGRAM, "s2", len(prompt) + 2)
        if why == "destination down":
            await b.stop()
        assert rt.mover is not None
        moved = await rt.mover.take_along(a.address, b.address, "s2", len(prompt) + 2, recompute_s=lambda n: 1.0)
        assert not moved
        stats = rt.mover.stats
        if why == "no room there":  # b's state says it has no room for the turn: not even tried
            assert (stats.num_moves, stats.num_failed, stats.num_skipped) == (0, 0, 1)
        else:  # tried (a node the router still has, or has no state of), and it failed
            assert (stats.num_moves, stats.num_failed) == (0, 1)
        assert rt.mover.planner.num_in_flight == 0 and rt.mover.planner.promised_blocks(b.address) == 0
        # Still whole at the source: the next turn there finds every token.
        script.target = a.address
        again = await rt.generate(PROGRAM, LLMInput("s2", prompt + first.token_ids + [9], max_new_tokens=2))
        assert again.node == a.address and again.num_cached_tokens >= 288 and not again.num_recomputed_tokens
    finally:
        await rt.stop()
    await _whole(a.address)
    if why == "no room there":
        await _whole(b.address)


def test_a_routed_move_needs_room_and_must_beat_recomputing() -> None:
    """``orchestrator.take_context_along``: the rule the live mover and the replay's migrator both call."""
    from orchestrator import NodeRoom, take_context_along

    room = NodeRoom("b", num_waiting=0, free_slots=1, room_blocks=63, block_size=16)  # 1,008 tokens
    assert take_context_along(1000, 1000, room, None, 0.01)  # no move measured yet: tried on faith
    assert not take_context_along(1000, 1009, room, None, 1.0)  # the turn would not fit there now
    assert not take_context_along(1000, 1000, NodeRoom("b", 0, 0, 63, 16), None, 1.0)  # no sequence slot
    assert not take_context_along(1000, 1000, room, 5e-4, 0.1)  # 0.5 ms a token measured: recomputing wins
    assert take_context_along(1000, 1000, room, 5e-4, 1.0)
    assert not take_context_along(0, 1000, room, None, 1.0)  # nothing to take along


async def test_a_queued_turn_moves_with_its_context_to_a_node_with_room(start_engine: Any) -> None:
    # a runs one sequence at a time: while another program's long turn runs there, s3's turn waits.
    a = await start_engine("a", num_device_blocks=96, scheduler={"max_num_seqs": 1})
    b = await start_engine("b", num_device_blocks=96)
    rt = HintRuntime([a.address, b.address], "hintflow", migrate=True)
    script = _Scripted()
    rt.router.policy = script
    await rt.start()
    try:
        await until(lambda: len(rt.router._nodes) == 2, 10.0, "both nodes in the router")
        prompt = [(5 * i) % 200 + 1 for i in range(300)]
        script.target = a.address
        first = await rt.generate(PROGRAM, LLMInput("s3", prompt, max_new_tokens=2))
        rt.turn_ended(PROGRAM, "s3", len(prompt) + 2)
        async with EngineClient(a.address) as ca:
            # s3's context stays on a (pinned) while a long turn of another program runs there
            await ca.push_hints([Pin(session_id="s3", ttl_s=30.0)])
            hog = asyncio.create_task(
                ca.generate([(11 * i) % 200 + 1 for i in range(200)], 800, session_id="hog", program_id="hog")
            )

            async def hog_running() -> bool:
                st = await ca.get_cache_state(include_sessions=True)
                return any(r.session_id == "hog" and r.state == "running" for r in st.sessions)

            await until(hog_running, 10.0, "the long turn running on a")
            second = await rt.generate(PROGRAM, LLMInput("s3", prompt + first.token_ids + [7] * 16, max_new_tokens=2))
            hog_done = hog.done()
            await hog
            await ca.push_hints([Release(program_id="hog")])
        assert rt.mover is not None
        assert second.node == b.address, (rt.mover.stats, hog_done)
        assert rt.mover.stats.num_queued_moves == 1 and not rt.mover.stats.num_failed
        assert rt.mover.planner.num_in_flight == 0
        assert second.num_cached_tokens >= 288 and not second.num_recomputed_tokens
        assert not hog_done  # it moved while the long turn still ran on a
    finally:
        await rt.stop()
    await _whole(a.address)
    await _whole(b.address)


async def test_a_turn_hints_go_to_the_node_the_turn_is_routed_to(start_engine: Any) -> None:
    """The turn's Priority reaches the node its router picked, not where its last turn ran: a node that
    never saw the program would otherwise queue the turn as the newest program's (measured in the demo:
    such turns waited 50-70 s behind every other program's)."""
    rt, a, b, script = await _scripted_runtime(start_engine, migrate=False)
    sent: dict[str, list[Any]] = {a.address: [], b.address: []}
    for addr, pub in rt.publishers.items():
        real = pub.publish

        def recording(batch: Any, addr: str = addr, real: Any = real) -> None:
            sent[addr].extend(batch)
            real(batch)

        pub.publish = recording  # type: ignore[method-assign]
    try:
        prompt = [(7 * i) % 200 + 1 for i in range(64)]
        script.target = a.address
        rt.turn_started(PROGRAM, "s1", len(prompt), routed=True)
        first = await rt.generate(PROGRAM, LLMInput("s1", prompt, max_new_tokens=4))
        rt.turn_ended(PROGRAM, "s1", len(prompt) + len(first.token_ids))
        assert [type(h) for h in sent[a.address]].count(Priority) == 1 and not sent[b.address]
        script.target = b.address
        rt.turn_started(PROGRAM, "s1", len(prompt) + 8, routed=True)
        second = await rt.generate(PROGRAM, LLMInput("s1", prompt + first.token_ids + [5] * 4, max_new_tokens=4))
        assert second.node == b.address
        assert [h.session_id for h in sent[b.address] if isinstance(h, Priority)] == ["s1"]
        assert [type(h) for h in sent[a.address]].count(Priority) == 1  # none for the turn that left a
        # Placed again (a failover or a queued move does this): sent again, but produced, and counted, once.
        emitted = rt.registry.get_sample_value("hintflow_hints_emitted_total", {"kind": "priority"})
        rt._place_turn_hints(rt.sessions["s1"])
        assert [h.session_id for h in sent[b.address] if isinstance(h, Priority)] == ["s1", "s1"]
        assert rt.registry.get_sample_value("hintflow_hints_emitted_total", {"kind": "priority"}) == emitted == 2.0
        rt.turn_ended(PROGRAM, "s1", None)
    finally:
        await rt.stop()
    await _whole(a.address)
    await _whole(b.address)
