"""ThunderAgent's pause/restore controller (``orchestrator.ThunderAgent``), alone and in the real-vLLM
harness's pusher, which holds a paused session's next turn until the controller restores it.

The pusher needs no node here: its target is a loopback port nobody serves (its pause hints fail and are
counted); what is checked is which turn waits, for how long, and what the controller decided.
"""

from __future__ import annotations

import threading
import time

from hints import MAX_HORIZON_S, EvictionOrder, Pin
from orchestrator import (
    SessionLoad,
    ThunderAgent,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
    thunder_pause_hints,
)
from replay._vllm_agents import HintPusher
from tests.polling import free_port


def test_a_thrashing_node_pauses_acting_sessions_shortest_first_until_its_load_fits() -> None:
    agent = ThunderAgent()
    sessions = [
        SessionLoad("run", "a", 600),  # reasoning: its prompt counts whole
        SessionLoad("long", "a", 500, acting_s=0.0),  # in a tool just now: weight 500
        SessionLoad("short", "a", 300, acting_s=0.0),
        SessionLoad("old", "a", 800, acting_s=3.0),  # three seconds in its tool: 800 / 8 = 100
        SessionLoad("b1", "b", 400),
    ]
    plan = agent.control(sessions, {"a": 1000, "b": 1000}, idle=[])
    # load on a: 600 + 500 + 300 + 100 = 1500; pausing the shortest first: old (800 tokens) is the
    # longest context, short (300) and long (500) go first -> 1500 - 300 - 500 = 700 <= 1000
    assert plan.pause == [("a", "short"), ("a", "long")] and agent.num_pauses == 2
    # then paused sessions still in a tool are let go where room remains (b: 400 + 300), shortest first:
    # their device KV is gone, but their next turn will not wait in the queue
    assert plan.restore == [] and plan.unpause == ["short"] and agent.paused == {"long"}


def test_held_turns_restore_shortest_first_where_there_is_room_or_on_an_idle_node() -> None:
    agent = ThunderAgent()
    agent.paused |= {"s", "m", "xl", "tool"}
    assert agent.hold("m", 500) and agent.hold("s", 200) and agent.hold("xl", 5000)
    assert not agent.hold("free", 100)  # not paused: it goes at once
    loads = [SessionLoad("busy", "a", 900), SessionLoad("tool", "b", 100, acting_s=1.0)]
    plan = agent.control(loads, {"a": 1000, "b": 1000}, idle=[])
    # b has 1000 free: s (200) then m (500) go there; xl fits nowhere and no node is idle: it waits,
    # and so does every paused session still in its tool
    assert plan.restore == [("s", "b"), ("m", "b")] and agent.queue == [("xl", 5000)]
    assert plan.unpause == [] and agent.paused == {"xl", "tool"}
    plan = agent.control([SessionLoad("tool", "b", 100, acting_s=2.0)], {"a": 1000, "b": 1000}, idle=["b"])
    assert plan.restore == [("xl", "b")]  # a context over any node's capacity still runs, on an idle one
    assert plan.unpause == ["tool"] and agent.paused == set() and agent.num_restores == 3


def test_a_pause_is_pushed_as_an_unpin_and_first_place_to_evict() -> None:
    hints = thunder_pause_hints(["a", "b"])
    assert hints[:2] == [Pin(session_id="a", ttl_s=0.0), Pin(session_id="b", ttl_s=0.0)]
    assert isinstance(hints[2], EvictionOrder)
    assert {(e.session_id, e.next_use_s) for e in hints[2].entries} == {("a", MAX_HORIZON_S), ("b", MAX_HORIZON_S)}
    assert thunder_pause_hints([]) == []


def test_the_harness_holds_a_paused_session_s_next_turn_until_the_controller_restores_it() -> None:
    pusher = HintPusher(f"127.0.0.1:{free_port()}", "thunderagent", tick_s=0.02, pool_tokens=1000,
                        thunder_period_s=0.2)  # fmt: skip
    try:
        pusher.t0 = time.monotonic()
        pusher.event(TurnStarted("p", "other", 0.0, 900))  # a long turn runs on the node
        pusher.event(TurnStarted("q", "mine", 0.0, 300))
        pusher.event(TurnEnded("q", "mine", 0.01, 320))
        pusher.event(ToolStarted("q", "mine", "bash", 0.01, 320))  # 900 + 320 > 1000: it is paused
        deadline = time.monotonic() + 5.0
        while "mine" not in pusher.thunder.paused and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        assert pusher.thunder is not None and pusher.thunder.paused == {"mine"}
        pusher.event(ToolEnded("q", "mine", "bash", time.monotonic() - pusher.t0, 0.3))
        held: list[float] = []
        waiter = threading.Thread(target=lambda: held.append(pusher.wait_turn("mine", 330, timeout_s=10.0)))
        waiter.start()
        time.sleep(0.6)  # three periods: 900 running + 330 does not fit, and the node is not idle
        assert waiter.is_alive() and pusher.thunder.queue == [("mine", 330)]
        pusher.event(TurnEnded("p", "other", time.monotonic() - pusher.t0, 920))  # room now
        waiter.join(5.0)
        assert held and held[0] >= 0.6 and pusher.thunder.num_restores == 1
        assert pusher.wait_turn("other", 920, timeout_s=1.0) < 0.5  # never paused: not held
        assert pusher.sent["Pin"] >= 1 and pusher.sent["EvictionOrder"] >= 1  # the pause went out as hints
    finally:
        pusher.close()


def test_without_the_controller_no_turn_waits() -> None:
    pusher = HintPusher(f"127.0.0.1:{free_port()}", "thunderagent", tick_s=0.02)
    try:
        assert pusher.thunder is None and pusher.wait_turn("s", 10, timeout_s=0.1) == 0.0
    finally:
        pusher.close()
