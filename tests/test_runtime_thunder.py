"""ThunderAgent's pause/restore controller on the live runtime (``HintRuntime(thunder_period_s=...)``,
``workflows/_thunder_live.py``): a session paused while in its tool has its next model call held until a
restore, which routes it to the node the controller chose.

Real parts: a torch engine node on loopback gRPC, the runtime's watch stream, publisher and client. The
controller's period is set beyond the test so that each period runs when the test calls it, with the time
it gives (the rule reads only the times it is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from tests.polling import until
from workflows import HintRuntime
from workflows._api import LLMInput


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 200 + 1 for i in range(n)]


async def test_a_paused_session_s_next_call_waits_for_its_restore(start_engine: Any) -> None:
    node = await start_engine("a", num_device_blocks=120)  # 1,920 tokens of 16-token blocks
    rt = HintRuntime([node.address], "thunderagent", thunder_period_s=3600.0, watch_interval_s=0.1)
    assert rt.thunder is not None
    await rt.start()
    try:
        await until(lambda: rt.router.node_state(node.address) is not None, 10.0, "the node in the router")
        first = {}
        for pid, sid, seed in (("p1", "s1", 1), ("p2", "s2", 2)):  # two 1,000-token contexts, then a tool each
            rt.turn_started(pid, sid, 1000, routed=True)
            first[sid] = await rt.generate(pid, LLMInput(sid, _prompt(seed, 1000), max_new_tokens=4))
            rt.turn_ended(pid, sid, 1004)
            rt.tool_started(pid, sid, "bash")
        # A third program's long call keeps the node busy: an idle node would take a paused session back
        # at once (the rule's way out for a context that fits nowhere).
        rt.turn_started("p3", "s3", 100, routed=True)
        busy = asyncio.create_task(rt.generate("p3", LLMInput("s3", _prompt(5, 100), max_new_tokens=1700)))

        def running() -> bool:
            st = rt.router.node_state(node.address)
            return st is not None and st.num_running > 0

        await until(running, 10.0, "the node seen running the long call")
        now = time.monotonic()
        rt.thunder.control(now)  # 100 + 1004 + 1004 > 1920: the shorter (then by name) is paused
        assert rt.thunder.agent.paused == {"s1"} and rt.thunder.agent.num_pauses == 1
        emitted = rt.registry.get_sample_value("hintflow_hints_emitted_total", {"kind": "eviction_order"})
        assert emitted is not None and emitted >= 1  # the pause went to the node: first to evict
        rt.tool_ended("p1", "s1", "bash", 0.1)
        rt.turn_started("p1", "s1", 420, routed=True)
        nxt = _prompt(1, 1000) + first["s1"].token_ids + [9] * 16
        call = asyncio.create_task(rt.generate("p1", LLMInput("s1", nxt, max_new_tokens=4)))
        await asyncio.sleep(0.3)
        assert not call.done() and rt.thunder.agent.queue == [("s1", len(nxt))]  # held, not sent
        rt.thunder.control(now + 10.0)  # ten seconds into its tool s2 weighs ~1: room for s1 (1,020)
        res = await asyncio.wait_for(call, 60.0)
        assert res.node == node.address and rt.thunder.agent.num_restores == 1
        assert rt.thunder.agent.paused == set() and rt.thunder.agent.queue == []
        rt.turn_ended("p1", "s1", len(nxt) + 4)
        await asyncio.wait_for(busy, 60.0)
        rt.turn_ended("p3", "s3", 1800)
        for pid in ("p1", "p2", "p3"):
            rt.program_ended(pid)
        assert rt.thunder._running == {} and rt.thunder._held == {}
    finally:
        await rt.stop()


@contextlib.asynccontextmanager
async def _held_call(start_engine: Any) -> AsyncIterator[tuple[HintRuntime, Any, asyncio.Task[Any]]]:
    """A runtime on one node, and session s1's call held (s1 paused, as a period would leave it)."""
    node = await start_engine("a", num_device_blocks=40)
    rt = HintRuntime([node.address], "thunderagent", thunder_period_s=3600.0)
    assert rt.thunder is not None
    await rt.start()
    try:
        await until(lambda: rt.router.node_state(node.address) is not None, 10.0, "the node in the router")
        rt.thunder.agent.paused.add("s1")
        rt.turn_started("p1", "s1", 100, routed=True)
        call = asyncio.create_task(rt.generate("p1", LLMInput("s1", _prompt(1, 100), max_new_tokens=2)))
        await asyncio.sleep(0.2)
        yield rt, node, call
    finally:
        await rt.stop()


async def test_a_held_call_whose_program_ends_goes_on_and_is_not_left_queued(start_engine: Any) -> None:
    async with _held_call(start_engine) as (rt, node, call):
        assert rt.thunder is not None
        assert not call.done() and rt.thunder.agent.queue == [("s1", 100)]
        rt.program_ended("p1", "cancelled")  # e.g. the workflow was cancelled while its call waited
        res = await asyncio.wait_for(call, 10.0)  # let go, routed as usual
        assert res.node == node.address
        assert rt.thunder.agent.queue == [] and "s1" not in rt.thunder.agent.paused


async def test_a_held_call_that_is_cancelled_leaves_the_queue_and_the_session_paused(start_engine: Any) -> None:
    async with _held_call(start_engine) as (rt, _node, call):
        assert rt.thunder is not None
        assert rt.thunder.agent.queue == [("s1", 100)]
        call.cancel()  # the activity was cancelled (a heartbeat timeout, the workflow's cancel)
        await asyncio.gather(call, return_exceptions=True)
        assert rt.thunder.agent.queue == [] and rt.thunder._held == {}
        assert rt.thunder.agent.paused == {"s1"}  # a retry of the call waits for a restore again
