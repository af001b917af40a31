"""The control core (``orchestrator.ControlCore``): the loop the live runtime, the replay and the real-vLLM
harness share.  Plain calls with times as arguments: no server, no clock."""

from __future__ import annotations

import time
from typing import Any

import pytest

from hints import EvictionOrder, NextUse, Pin, Release
from orchestrator import ControlCore, ProgramEnded, Tick, ToolEnded, ToolStarted, TurnEnded, TurnStarted


class _Recorder:
    """A policy that records what it is fed and answers each ToolStarted with a pin."""

    name = "recorder"
    num_invalid_hints = 0

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_event(self, ev: Any) -> list[Any]:
        self.seen.append(ev)
        if isinstance(ev, ToolStarted):
            return [Pin(session_id=ev.session_id, ttl_s=1.0, reason="tool")]
        if isinstance(ev, ProgramEnded):
            return [Release(program_id=ev.program_id)]
        return []

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.seen]


def _core(**kw: Any) -> tuple[ControlCore, _Recorder]:
    policy = _Recorder()
    return ControlCore(policy, **kw), policy  # type: ignore[arg-type]


def test_a_pause_runs_from_the_tool_s_start_to_the_next_turn() -> None:
    core, policy = _core()
    core.turn_started("p", "s", 0.0, 100)
    core.turn_ended("p", "s", 1.0, 120)
    core.tool_started("p", "s", "bash", 1.0)  # context: the session's last known
    assert core.tool_returned("p", "s", "bash", 3.0, 2.0) == []  # returned: the context still waits
    assert core.num_paused == 1
    core.turn_started("p", "s", 3.5, 140)
    [started] = [e for e in policy.seen if isinstance(e, ToolStarted)]
    [ended] = [e for e in policy.seen if isinstance(e, ToolEnded)]
    assert started.context_tokens == 120
    assert ended.duration_s == pytest.approx(2.5)  # the whole idle time, scheduling of the next turn included
    assert policy.kinds() == ["TurnStarted", "TurnEnded", "ToolStarted", "ToolEnded", "TurnStarted"]


def test_parallel_tools_are_one_pause_and_the_grace_period_ends_it_at_the_return() -> None:
    core, policy = _core(tool_grace_s=0.5)
    core.turn_ended("p", "s", 0.0, 100)
    core.tool_started("p", "s", "A", 1.0)
    core.tool_started("p", "s", "B", 1.2)  # beside A: joins its pause
    core.tool_returned("p", "s", "A", 2.0, 1.0)
    assert core.sweep(10.0) == [] and core.num_paused == 1  # B still runs
    core.tool_returned("p", "s", "B", 4.0, 2.8)
    assert core.sweep(4.2) == [] and core.num_paused == 1  # within the grace period
    core.sweep(4.6)
    [ended] = [e for e in policy.seen if isinstance(e, ToolEnded)]
    assert (ended.tool, ended.duration_s) == ("A", pytest.approx(3.0))  # to the return, not the sweep
    assert core.num_paused == 0 and [type(e).__name__ for e in policy.seen].count("ToolStarted") == 1


def test_a_return_with_no_pause_open_is_reported_as_measured() -> None:
    core, policy = _core()
    core.tool_returned("p", "s", "bash", 5.0, 1.5)  # e.g. a restart lost the start
    [ended] = policy.seen
    assert isinstance(ended, ToolEnded) and ended.duration_s == 1.5


def test_ticks_reach_the_policy_only_while_a_pause_is_open() -> None:
    core, policy = _core()
    core.turn_started("p", "s", 0.0, 10)
    core.tick(0.1)
    assert not [e for e in policy.seen if isinstance(e, Tick)]
    core.tool_started("p", "s", "bash", 0.2, 12)
    core.tick(0.3)
    assert [e.now_s for e in policy.seen if isinstance(e, Tick)] == [0.3]
    core.program_ended("p", 0.4, 1)  # closes the pause, then the program's end
    assert policy.kinds()[-2:] == ["ToolEnded", "ProgramEnded"] and core.num_paused == 0
    core.tick(0.5)
    assert len([e for e in policy.seen if isinstance(e, Tick)]) == 1


def test_a_policy_that_raises_is_counted_and_the_loop_goes_on() -> None:
    class Flaky(_Recorder):
        def on_event(self, ev: Any) -> list[Any]:
            out = super().on_event(ev)
            if isinstance(ev, TurnEnded):
                raise RuntimeError("a policy bug")
            return out

    policy = Flaky()
    core = ControlCore(policy)  # type: ignore[arg-type]
    core.turn_started("p", "s", 0.0, 10)
    assert core.turn_ended("p", "s", 1.0, 12) == []
    assert core.num_policy_errors == 1
    assert core.tool_started("p", "s", "bash", 1.0) == [Pin(session_id="s", ttl_s=1.0, reason="tool")]


def test_hints_go_to_the_node_holding_the_session_and_release_to_every_node() -> None:
    where = {"s": "b"}
    core, _ = _core(nodes=["a", "b"], node_of=where.get)
    pin = Pin(session_id="s", ttl_s=1.0, reason="tool")
    other = Pin(session_id="t", ttl_s=1.0, reason="tool")
    order = EvictionOrder(entries=[NextUse(session_id="s", next_use_s=1.0), NextUse(session_id="t", next_use_s=2.0)])
    out = core.address([pin, other, order, Release(program_id="p")])
    assert out["b"][0] == pin and pin not in out["a"]
    assert other in out["a"] and other in out["b"]  # a session no node holds: every node
    assert [len(h.entries) for h in out["a"] if isinstance(h, EvictionOrder)] == [1]
    assert all(any(isinstance(h, Release) for h in batch) for batch in out.values())
    where["s"] = "gone"  # a node the core does not know: every node
    assert pin in core.address([pin])["a"]


def test_pins_are_priced_by_the_copy_back_only_once_every_node_has_a_host_tier() -> None:
    core = ControlCore("hintflow", nodes=["a", "b"])
    policy: Any = core.policy
    core.node_seen("a", host_tier=True, pool_tokens=1000, host_hit_fraction=0.2, reload_s_per_token=1e-5)
    assert policy.host_reload is None  # b has not said
    hit = {"b": 0.6}
    core.node_seen("b", host_tier=True, pool_tokens=800, host_hit_fraction=lambda: hit["b"], reload_s_per_token=3e-5)
    assert policy.host_reload(1000) == pytest.approx(3e-5 * 1000)  # the slowest node's copy
    assert policy.host_hit_fraction() == pytest.approx(0.4)
    hit["b"] = 1.0  # a node's live measure is read at each decision
    assert policy.host_hit_fraction() == pytest.approx(0.6)
    core.node_seen("b", host_tier=False, pool_tokens=800)
    assert policy.host_reload is None and policy.host_hit_fraction is None


def test_the_runtime_and_the_vllm_harness_feed_a_policy_as_the_core_does() -> None:
    """One program's events through the live runtime's methods and through the harness's pusher reach the
    policy as the same sequence (the shells own no loop rules of their own)."""
    from replay._vllm_agents import HintPusher
    from tests.polling import free_port
    from workflows import HintRuntime

    rt = HintRuntime(["127.0.0.1:1"], _Recorder(), tool_grace_s=60.0)  # type: ignore[arg-type]
    rt.turn_started("p", "s", 100)
    rt.turn_ended("p", "s", 120)
    rt.tool_started("p", "s", "bash")
    rt.tool_ended("p", "s", "bash", 0.01)
    rt.turn_started("p", "s", 140)
    rt.turn_ended("p", "s", 160)
    rt.program_ended("p")
    live = rt.policy.kinds()  # type: ignore[attr-defined]

    pusher = HintPusher(f"127.0.0.1:{free_port()}", "hintflow", tick_s=3600.0)
    try:
        recorder = _Recorder()
        pusher.core.policy = recorder  # type: ignore[assignment]
        for ev in (TurnStarted("p", "s", 0.0, 100), TurnEnded("p", "s", 0.1, 120),
                   ToolStarted("p", "s", "bash", 0.1, 120), ToolEnded("p", "s", "bash", 0.2, 0.1),
                   TurnStarted("p", "s", 0.3, 140), TurnEnded("p", "s", 0.4, 160), ProgramEnded("p", 0.5, 2)):
            pusher.event(ev)
        deadline = time.monotonic() + 5.0
        while "ProgramEnded" not in recorder.kinds() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pusher.close()
    harness = [k for k in recorder.kinds() if k != "Tick"]
    assert live == harness == ["TurnStarted", "TurnEnded", "ToolStarted", "ToolEnded", "TurnStarted", "TurnEnded",
                               "ProgramEnded"]
    [ended] = [e for e in recorder.seen if isinstance(e, ToolEnded)]
    assert ended.duration_s == pytest.approx(0.2)  # to the next turn, not the tool's own 0.1 s


T_PRICED = "hintflow:measured_price=false"


@pytest.mark.parametrize(
    "spec", [T_PRICED, f"{T_PRICED},backlog_floor=false", "continuum", f"{T_PRICED},queue_delay=false"]
)
def test_hintflow_prices_t_at_least_the_wait_behind_the_nodes_prefill_backlog(spec: str) -> None:
    """As the vLLM node's own inference did: Continuum's T is 0 until evicted turns were seen queueing, so
    under a sudden load no pin would pay; the nodes' backlog is the wait a recomputed turn sees now.  With
    ``queue_delay=false`` hintflow leaves T out of a pin's price altogether."""
    backlog = {"a": 0}
    core = ControlCore(spec, nodes=["a", "b"], prefill_prior=lambda n: 1e-3 * n)
    core.node_seen("a", host_tier=False, pool_tokens=1000, prefill_backlog_tokens=lambda: backlog["a"])
    core.node_seen("b", host_tier=False, pool_tokens=1000, prefill_backlog_tokens=3000)
    ttl: Any = core.policy.ttl  # type: ignore[attr-defined]
    counted = "queue_delay=false" not in spec
    floored = spec == T_PRICED
    assert ttl.queue_delay_s == pytest.approx(1.5 if floored else 0.0)  # the mean of 0 s and 3 s
    backlog["a"] = 1000  # read at each decision
    assert ttl.queue_delay_s == pytest.approx(2.0 if floored else 0.0)
    ttl.observe_evicted_queue_delay(5.0)  # a measured T above the floor stands
    assert ttl.queue_delay_s == pytest.approx(5.0 if counted else 0.0)
    if not counted:  # a pin is then worth the re-prefill alone
        assert ttl.benefit_s(1000) == pytest.approx(ttl.prefill_reload(1000) * ttl.memory_scale(1000))



def test_hintflow_prices_a_pin_by_what_the_nodes_measure() -> None:
    """The default price with no host tier: the re-prefill, less what the nodes keep of unpinned contexts,
    weighed by how much of their step time is prefill (p / (1 - p), never below 1), per share of the pool;
    T is not in it.  The readings are the nodes' (their mean), read at each decision."""
    reading = {"p": 0.0, "s": 0.0}
    core = ControlCore("hintflow", nodes=["a", "b"], prefill_prior=lambda n: 1e-3 * n)
    core.node_seen("a", host_tier=False, pool_tokens=4000, prefill_share=lambda: reading["p"],
                   unpinned_survival=lambda: reading["s"])
    core.node_seen("b", host_tier=False, pool_tokens=4000, prefill_share=0.8, unpinned_survival=0.5)
    ttl: Any = core.policy.ttl  # type: ignore[attr-defined]
    ttl.observe_evicted_queue_delay(50.0)  # T, however long, is not counted
    reload_s = 1e-3 * 1000
    assert ttl.benefit_s(1000) == pytest.approx(reload_s * 0.75 * 1.0 * 4.0)  # p 0.4: the floor of 1
    reading.update(p=0.9, s=0.1)  # mean p 0.85, s 0.3
    assert ttl.benefit_s(1000) == pytest.approx(reload_s * 0.7 * (0.85 / 0.15) * 4.0)
    reading.update(p=1.0, s=0.0)  # mean p 0.9, s 0.25
    assert ttl.benefit_s(1000) == pytest.approx(reload_s * 0.75 * (0.9 / 0.1) * 4.0)
    # a pause that returns before the pin lapses pays: a long price pins through the default pause
    assert ttl.ttl("bash", 1000) > 0.0
