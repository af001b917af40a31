"""The event-to-hints policies on a scripted 3-turn program: what each registered policy sends, and when."""

from __future__ import annotations

import math

import pytest

from hints import EvictionOrder, Pin, Prefetch, Priority, Release
from orchestrator import (
    POLICIES,
    HintPolicy,
    ProgramEnded,
    Tick,
    ToolEnded,
    ToolStarted,
    TurnEnded,
    TurnStarted,
    get_policy,
)
from predictors import PauseModel

P, S = "prog-1", "sess-1"


def three_turn_program(ctx: int = 8000) -> list:
    """turn (0-1) -> bash (1-3) -> turn (3-4) -> bash (4-6) -> turn (6-7) -> end."""
    return [
        TurnStarted(P, S, 0.0, ctx),
        TurnEnded(P, S, 1.0, ctx),
        ToolStarted(P, S, "bash", 1.0, ctx),
        ToolEnded(P, S, "bash", 3.0, 2.0),
        TurnStarted(P, S, 3.0, ctx),
        TurnEnded(P, S, 4.0, ctx),
        ToolStarted(P, S, "bash", 4.0, ctx),
        ToolEnded(P, S, "bash", 6.0, 2.0),
        TurnStarted(P, S, 6.0, ctx),
        TurnEnded(P, S, 7.0, ctx),
        ProgramEnded(P, 7.0, 3),
    ]


def run(policy: HintPolicy, events: list) -> list[tuple[object, list]]:
    return [(ev, policy.on_event(ev)) for ev in events]


def hints_at(trace: list[tuple[object, list]], event_type: type) -> list:
    return [h for ev, hs in trace if isinstance(ev, event_type) for h in hs]


def test_registry_and_protocol() -> None:
    assert set(POLICIES) == {"vllm-default", "continuum", "kvflow", "thunderagent", "hintflow"}
    for name in POLICIES:
        policy = get_policy(name, pause_model=PauseModel(), prefill_reload=lambda n: 0.0)
        assert isinstance(policy, HintPolicy)
        assert policy.name == name


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown policy 'lru'") as info:
        get_policy("lru")
    for name in POLICIES:
        assert name in str(info.value)


def test_vllm_default_emits_nothing() -> None:
    policy = get_policy("vllm-default")
    trace = run(policy, [*three_turn_program(), Tick(8.0)])
    assert all(hs == [] for _, hs in trace)


def test_continuum_pins_when_reload_is_expensive() -> None:
    policy = get_policy("continuum", prefill_reload=lambda n: 10.0)
    trace = run(policy, three_turn_program())
    pins = hints_at(trace, ToolStarted)
    assert len(pins) == 2 and all(isinstance(p, Pin) for p in pins)
    # cold start: Exp(1) tools, eta = 1, T = 0 -> tau = ln B
    assert all(p.ttl_s > 0 and p.ttl_s == pytest.approx(math.log(10.0), abs=0.05) for p in pins)
    prios = hints_at(trace, TurnStarted)
    assert [type(h) for h in prios] == [Priority] * 3
    assert [h.program_age_s for h in prios] == [0.0, 3.0, 6.0]
    assert hints_at(trace, ProgramEnded) == [Release(program_id=P)]
    assert not any(isinstance(h, EvictionOrder) for _, hs in trace for h in hs)
    assert policy.num_invalid_hints == 0


def test_continuum_does_not_pin_when_reload_is_free() -> None:
    policy = get_policy("continuum", prefill_reload=lambda n: 0.0)
    pins = [h for h in hints_at(run(policy, three_turn_program()), ToolStarted) if isinstance(h, Pin)]
    assert all(p.ttl_s == 0.0 for p in pins)


def test_continuum_learns_pauses_and_renews_on_tick() -> None:
    pm = PauseModel(min_samples=1)
    policy = get_policy("continuum", pause_model=pm, prefill_reload=lambda n: 10.0)
    run(policy, three_turn_program())
    assert pm.num_samples("bash") == 2  # ToolEnded fed the pause model
    assert policy.ttl._num_programs == 1  # ProgramEnded fed eta

    # Learned pauses: the renewal is decided on T - t given T > t, here the same as the first pin.
    pm1 = PauseModel(min_samples=1)
    for d in [1.0, 5.0, 9.0]:
        pm1.observe("bash", d)
    policy = get_policy("continuum", pause_model=pm1, prefill_reload=lambda n: 20.0)
    [pin] = policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    assert policy.on_event(Tick(pin.ttl_s / 2)) == []  # still held: nothing to do
    [renewed] = policy.on_event(Tick(pin.ttl_s + 0.1))
    assert isinstance(renewed, Pin) and renewed.ttl_s > 0.0


def test_a_stuck_tool_keeps_its_pin_only_within_the_cold_start_default_s_range() -> None:
    """Exp(1) is memoryless: renewing on it would give a tool that never returns the same pin forever.
    The default is a prior, so pins decided on it are renewed only while the pause is within its 99th
    percentile (ln 100 = 4.6 mean pause times), then dropped once."""
    for name in ("continuum", "hintflow"):
        policy = get_policy(name, pause_model=PauseModel(), prefill_reload=lambda n: 4.0)
        pins = [h for h in policy.on_event(ToolStarted(P, S, "bash", 0.0, 4000)) if isinstance(h, Pin)]
        assert pins and pins[0].ttl_s == pytest.approx(math.log(4.0), rel=0.01)  # tau* = ln B (on a grid)
        later = [(0.05 * t, h) for t in range(1, 72_000) for h in policy.on_event(Tick(0.05 * t))
                 if isinstance(h, Pin)]
        renewals = [t for t, h in later if h.ttl_s > 0.0]
        drops = [t for t, h in later if h.ttl_s == 0.0]
        assert renewals and max(renewals) < math.log(100.0) + 0.05, name
        assert len(drops) == 1 and drops[0] > math.log(100.0) - 1.5, name  # then nothing for an hour


def test_continuum_drops_pin_when_renewal_no_longer_pays() -> None:
    pm = PauseModel(min_samples=1)
    for d in [1.0, 1.0, 1.0, 50.0]:
        pm.observe("bash", d)
    policy = get_policy("continuum", pause_model=pm, prefill_reload=lambda n: 5.0)
    [pin] = policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    assert pin.ttl_s == 1.0
    # after 1.5 s only the 50 s sample is left: waiting 48.5 s more for a 5 s saving does not pay
    [drop] = policy.on_event(Tick(1.5))
    assert isinstance(drop, Pin) and drop.ttl_s == 0.0
    assert policy.on_event(Tick(3.0)) == []  # dropped once, not every tick


def test_kvflow_orders_parked_sessions_without_pins() -> None:
    policy = get_policy("kvflow")
    trace = run(policy, three_turn_program())
    hints = [h for _, hs in trace for h in hs]
    assert not any(isinstance(h, Pin | Priority) for h in hints)
    orders = [h for h in hints if isinstance(h, EvictionOrder)]
    assert orders and all(e.session_id == S and e.next_use_s > 0 for o in orders for e in o.entries)
    assert hints[-1] == Release(program_id=P)


def test_thunderagent_priority_and_release_only() -> None:
    trace = run(get_policy("thunderagent", prefill_reload=lambda n: 10.0), three_turn_program())
    kinds = [type(h) for _, hs in trace for h in hs]
    assert kinds == [Priority, Priority, Priority, Release]


def test_hintflow_full_program() -> None:
    policy = get_policy("hintflow", prefill_reload=lambda n: 10.0)
    trace = run(policy, three_turn_program())
    at_tool = hints_at(trace, ToolStarted)
    assert [type(h) for h in at_tool] == [Pin, EvictionOrder] * 2
    assert at_tool[0].ttl_s > 0
    assert at_tool[1].entries[0].session_id == S
    assert at_tool[1].entries[0].next_use_s == pytest.approx(1.0)  # Exp(1) default: remaining = mean
    assert [type(h) for h in hints_at(trace, TurnStarted)] == [Priority] * 3
    assert hints_at(trace, ProgramEnded) == [Release(program_id=P)]


def test_hintflow_resends_eviction_order_only_when_prediction_changes() -> None:
    pm = PauseModel(min_samples=1)
    for d in [1.0, 10.0]:
        pm.observe("bash", d)
    policy = get_policy("hintflow", pause_model=pm, prefill_reload=lambda n: 0.0)
    hints = policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    [order] = [h for h in hints if isinstance(h, EvictionOrder)]
    assert order.entries[0].next_use_s == pytest.approx(5.5)
    # at 0.5 s the prediction is 5.0 s: the same moment (5.5) as already sent -> nothing re-sent
    assert [h for h in policy.on_event(Tick(0.5)) if isinstance(h, EvictionOrder)] == []
    # at 2 s only the 10 s sample remains: next use moves from 5.5 to 10 -> re-sent
    [update] = [h for h in policy.on_event(Tick(2.0)) if isinstance(h, EvictionOrder)]
    assert update.entries[0].next_use_s == pytest.approx(8.0)
    assert [h for h in policy.on_event(Tick(2.5)) if isinstance(h, EvictionOrder)] == []
    # once the tool ended the session is no longer predicted
    policy.on_event(ToolEnded(P, S, "bash", 3.0, 3.0))
    assert policy.on_event(Tick(20.0)) == []


def test_hintflow_tick_with_default_model_is_incremental() -> None:
    policy = get_policy("hintflow", prefill_reload=lambda n: 0.0)
    policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    assert policy.on_event(Tick(0.05)) == []  # memoryless: drifted 0.05 s of 1 s
    assert len(policy.on_event(Tick(0.5))) == 1  # drifted 0.5 s: re-sent


@pytest.mark.parametrize("name", ["continuum", "hintflow"])
def test_nan_reload_drops_pins_and_counts_them(name: str, caplog: pytest.LogCaptureFixture) -> None:
    policy = get_policy(name, prefill_reload=lambda n: math.nan)
    trace = run(policy, three_turn_program())
    hints = [h for _, hs in trace for h in hs]
    assert not any(isinstance(h, Pin) for h in hints)
    # two tool starts; hintflow also pins at the ends of turns 2 and 3 (its graph has seen llm -> tool)
    assert policy.num_invalid_hints == {"continuum": 2, "hintflow": 4}[name]
    assert "dropped an invalid Pin" in caplog.text
    assert hints[-1] == Release(program_id=P)  # the rest still flows
    if name == "hintflow":
        assert sum(isinstance(h, EvictionOrder) for h in hints) == 2


def test_a_prediction_that_turns_bad_on_a_tick_is_counted_every_time() -> None:
    """Unchanged predictions of sessions already sent skip building a hint; a bad one (here NaN, once the
    session was sent) still takes the checked path and is counted and dropped on every tick."""

    class Flaky(PauseModel):
        bad = False

        def expected_remaining(self, tool: str, elapsed_s: float) -> float:
            return math.nan if self.bad else 1.0

    model = Flaky()
    policy = get_policy("hintflow", pause_model=model, prefill_reload=lambda n: 0.0)
    policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    assert policy.on_event(Tick(0.05)) == [] and policy.num_invalid_hints == 0  # unchanged: nothing sent
    model.bad = True
    assert policy.on_event(Tick(0.10)) == [] and policy.on_event(Tick(0.15)) == []
    assert policy.num_invalid_hints == 2
    model.bad = False  # good again, and its deadline has moved 0.2 s of 1 s: re-sent
    assert len(policy.on_event(Tick(0.20))) == 1 and policy.num_invalid_hints == 2


def test_negative_prediction_is_dropped_not_sent() -> None:
    class BrokenModel(PauseModel):
        def expected_remaining(self, tool: str, elapsed_s: float) -> float:
            return -1.0

    policy = get_policy("hintflow", pause_model=BrokenModel(), prefill_reload=lambda n: 10.0)
    hints = policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))
    assert [type(h) for h in hints] == [Pin]
    assert policy.num_invalid_hints == 1


def test_hintflow_prefetches_only_when_the_pin_may_end_before_the_return() -> None:
    """Exp(1 s) default: q25 = ln(4/3) s, q90 = ln 10 s.  A short pin (cheap reload) leaves the likely
    returns uncovered -> Prefetch at 0.8 * q25; a pin past q90 (expensive reload) needs no prefetch."""
    cheap = get_policy("hintflow", prefill_reload=lambda n: 1.5)  # tau = ln 1.5 < q90
    hints = cheap.on_event(ToolStarted("p", "s", "bash", 0.0, 1000))
    [prefetch] = [h for h in hints if isinstance(h, Prefetch)]
    assert prefetch.at_s == pytest.approx(0.8 * math.log(4 / 3), rel=1e-3)
    dear = get_policy("hintflow", prefill_reload=lambda n: 50.0)  # tau = ln 50 > q90 = ln 10
    hints = dear.on_event(ToolStarted("p", "s", "bash", 0.0, 1000))
    assert any(isinstance(h, Pin) for h in hints)
    assert not any(isinstance(h, Prefetch) for h in hints)


def test_hintflow_prices_a_pin_by_the_cheaper_of_reprefill_and_host_reload() -> None:
    """Re-prefill 10 s would pay a pin (tau = ln 10 for Exp(1) pauses); a 0.5 s reload from the host tier
    does not (B < 1).  Continuum prices re-prefill alone, as its paper does."""
    ev = ToolStarted("p", "s", "bash", 0.0, 1000)
    pins = [h for h in get_policy("hintflow", prefill_reload=lambda n: 10.0).on_event(ev) if isinstance(h, Pin)]
    assert pins and pins[0].ttl_s == pytest.approx(math.log(10.0), rel=1e-3)
    ours = get_policy("hintflow", prefill_reload=lambda n: 10.0, host_reload=lambda n: 0.5)
    assert not [h for h in ours.on_event(ev) if isinstance(h, Pin) and h.ttl_s > 0]
    theirs = get_policy("continuum", prefill_reload=lambda n: 10.0, host_reload=lambda n: 0.5)
    assert [h for h in theirs.on_event(ev) if isinstance(h, Pin) and h.ttl_s > 0]


def test_hintflow_with_a_host_tier_leaves_queueing_out_of_a_pins_price() -> None:
    """Queueing observed on evicted turns (T = 20 s) would make Continuum pin for ln(20.5) s; with a host
    tier hintflow prices the pin by the 0.5 s reload alone (B < 1: no pin).  Without one, by the 10 s
    re-prefill and T (ln 30 s), or by the re-prefill alone with ``queue_delay=False`` (ln 10 s)."""
    ev = ToolStarted("p", "s", "bash", 0.0, 1000)

    def pin_ttl(name: str, **kw: object) -> float:
        policy = get_policy(name, prefill_reload=lambda n: 10.0, **kw)  # type: ignore[arg-type]
        for _ in range(5):
            policy.ttl.observe_evicted_queue_delay(20.0)  # type: ignore[attr-defined]
        return max((h.ttl_s for h in policy.on_event(ev) if isinstance(h, Pin)), default=0.0)

    assert pin_ttl("continuum", host_reload=lambda n: 0.5) == pytest.approx(math.log(30.0), rel=1e-2)
    assert pin_ttl("hintflow") == pytest.approx(math.log(30.0), rel=1e-2)  # no host tier: T counts
    assert pin_ttl("hintflow", queue_delay=False) == pytest.approx(math.log(10.0), rel=1e-2)  # re-prefill alone
    assert pin_ttl("hintflow", host_reload=lambda n: 0.5) == 0.0


def _lost_share_pin_ttl(readings: tuple[float, float] | None = None, **kw: object) -> float:
    """The pin hintflow sends at a tool start on nodes whose host tier gives nothing back (h = 0), with a
    10 s re-prefill, a 0.5 s copy back, T = 20 s observed and, if given, the nodes' readings (p, s)."""
    policy = get_policy("hintflow", prefill_reload=lambda n: 10.0, host_reload=lambda n: 0.5,
                        host_hit_fraction=lambda: 0.0, **kw)  # type: ignore[arg-type]
    if readings is not None:
        p, s = readings
        policy.set_node_signals(lambda: p, lambda: s)
    for _ in range(5):
        policy.ttl.observe_evicted_queue_delay(20.0)  # type: ignore[attr-defined]
    hints = policy.on_event(ToolStarted("p", "s", "bash", 0.0, 1000))
    return max((h.ttl_s for h in hints if isinstance(h, Pin)), default=0.0)


def test_hintflow_queue_delay_option_reaches_the_host_tiers_lost_share() -> None:
    """A host tier that gives nothing back (h = 0) prices a pin as a lost context: the 10 s re-prefill and T
    (20 s observed: ln 30 s); ``queue_delay=False`` leaves T out there too (ln 10 s)."""
    assert _lost_share_pin_ttl(measured_price=False) == pytest.approx(math.log(30.0), rel=1e-2)
    assert _lost_share_pin_ttl(measured_price=False, queue_delay=False) == pytest.approx(math.log(10.0), rel=1e-2)


def test_hintflow_prices_the_host_tiers_lost_share_by_t_whatever_the_nodes_read() -> None:
    """A host tier that gives nothing back and T = 20 s: a pin is worth re-prefill and T (ln 30 s) with the
    nodes' readings too (p = 0.8, s = 0.5 would make the measured price 10 s * 0.5 * 4 = 20 s): on the real
    vLLM node with a short host tier the measured price there lost 30% of mean JCT (``HostTierTTL``)."""
    assert _lost_share_pin_ttl((0.8, 0.5)) == pytest.approx(math.log(30.0), rel=1e-2)
    assert _lost_share_pin_ttl((0.8, 0.5), measured_price=False) == pytest.approx(math.log(30.0), rel=1e-2)


def test_hintflow_pins_at_turn_end_once_the_graph_knows_a_tool_follows() -> None:
    policy = get_policy("hintflow", prefill_reload=lambda n: 10.0)
    trace = run(policy, three_turn_program())
    turn_ends = [hs for ev, hs in trace if isinstance(ev, TurnEnded)]
    first, second = turn_ends[0], turn_ends[1]
    assert not [h for h in first if isinstance(h, Pin)]  # nothing learned yet
    [pin] = [h for h in second if isinstance(h, Pin)]
    assert pin.ttl_s == pytest.approx(math.log(10.0), rel=1e-3) and pin.reason == "turn-end:bash"


def test_kvflow_steps_are_steps_to_execution_over_the_event_dag() -> None:
    from orchestrator import steps_to_execution

    policy = get_policy("kvflow")
    events = [TurnStarted(P, "a", 0.0, 100), TurnEnded(P, "a", 1.0, 110), ToolStarted(P, "a", "bash", 1.0, 110),
              TurnStarted(P, "b", 1.0, 100), TurnEnded(P, "b", 2.0, 110),
              TurnStarted(P, "c", 2.0, 100), TurnEnded(P, "c", 3.0, 110), ToolStarted(P, "c", "edit", 3.0, 110)]  # fmt: skip
    for ev in events:
        policy.on_event(ev)
    g, running = policy.event_dag()  # type: ignore[attr-defined]
    assert running == {"tool:a", "tool:c"} and set(g.nodes) >= {"next:a", "next:b", "next:c"}
    values = steps_to_execution(g, running)
    want = {sid: values[f"next:{sid}"] for sid in ("a", "b", "c")}
    assert policy._steps() == want == {"a": 1.0, "b": 1.0, "c": 1.0}  # type: ignore[attr-defined]


def test_kvflow_sends_a_finished_agent_first_when_its_framework_says_so() -> None:
    """KVFlow's framework knows the agent step graph, so an agent with no step left is never reached: its
    context goes to the horizon (first to evict), the others stay one step away; the program's end forgets it."""
    from hints import MAX_HORIZON_S
    from orchestrator import ProgramEnded

    policy = get_policy("kvflow")
    for ev in [TurnStarted(P, "a", 0.0, 100), TurnEnded(P, "a", 1.0, 110), ToolStarted(P, "a", "bash", 1.0, 110),
               TurnStarted(P, "b", 1.0, 100), TurnEnded(P, "b", 2.0, 110)]:  # fmt: skip
        policy.on_event(ev)
    assert policy.note_agent_finished("nobody", 2.0) == []  # type: ignore[attr-defined]
    hints = policy.note_agent_finished("b", 2.0)  # type: ignore[attr-defined]
    entries = {e.session_id: e.next_use_s for h in hints if isinstance(h, EvictionOrder) for e in h.entries}
    assert entries["b"] == MAX_HORIZON_S
    assert policy._steps() == {"a": 1.0, "b": math.inf}  # type: ignore[attr-defined]
    policy.on_event(ProgramEnded(P, 3.0, 2))
    assert policy._finished_agents == {}  # type: ignore[attr-defined]


def test_hintflow_reprices_pins_when_its_nodes_gain_a_host_tier_and_keeps_what_it_learned() -> None:
    from predictors import ContinuumTTL
    from predictors import HostTierTTL as _HostTierTTL

    policy = get_policy("hintflow", prefill_reload=lambda n: 10.0)
    for n in (3, 5, 8, 13, 2, 7, 4, 9, 6, 11, 3, 5):
        policy.ttl.observe_program_finished(n)
    policy.ttl.observe_evicted_queue_delay(2.0)
    eta, t = policy.ttl.eta, policy.ttl.queue_delay_s
    assert type(policy.ttl) is ContinuumTTL and t == 2.0
    policy.set_host_reload(lambda n: 0.001)  # type: ignore[attr-defined]
    assert isinstance(policy.ttl, _HostTierTTL) and policy.ttl.eta == eta
    assert policy.ttl.queue_delay_s == 0.0  # no queueing term with a host tier
    pins = [h for h in policy.on_event(ToolStarted(P, S, "bash", 1.0, 8000)) if isinstance(h, Pin)]
    assert [p.ttl_s for p in pins] in ([], [0.0])  # a 1 ms copy back never pays for holding memory
    policy.set_host_reload(None)  # type: ignore[attr-defined]
    assert type(policy.ttl) is ContinuumTTL and policy.ttl.queue_delay_s == t and policy.ttl.eta == eta
    pins = [h for h in policy.on_event(ToolStarted(P, "s2", "bash", 2.0, 8000)) if isinstance(h, Pin)]
    assert pins and pins[0].ttl_s > 0  # the same pause is worth a pin when the context would be re-prefilled
    ttl_without_host = pins[0].ttl_s
    # a host tier that gives nothing back (the node measures it): priced as the re-prefill it is
    hit = [0.0]
    policy.set_host_reload(lambda n: 0.001, lambda: hit[0])  # type: ignore[attr-defined]
    pins = [h for h in policy.on_event(ToolStarted(P, "s3", "bash", 3.0, 8000)) if isinstance(h, Pin)]
    assert pins and pins[0].ttl_s == pytest.approx(ttl_without_host, rel=0.05)
    hit[0] = 1.0  # read at each decision: once the tier gives everything back, no pin pays again
    pins = [h for h in policy.on_event(ToolStarted(P, "s4", "bash", 4.0, 8000)) if isinstance(h, Pin)]
    assert [p.ttl_s for p in pins] in ([], [0.0])


def test_min_change_s_bounds_how_often_a_memoryless_prediction_is_re_sent() -> None:
    """A prediction that stays "D from now" moves its deadline with the clock: by default it is re-sent
    whenever that drift passes rel_change * D (every other tick for D = 1 s); min_change_s bounds it."""

    def orders(**kw: float) -> int:
        policy = get_policy("hintflow", pause_model=PauseModel(), prefill_reload=lambda n: 0.5, **kw)
        policy.on_event(ToolStarted(P, S, "bash", 0.0, 100))  # Exp(1) remaining: 1 s, whatever the elapsed
        return sum(isinstance(h, EvictionOrder) for t in range(1, 201) for h in policy.on_event(Tick(0.05 * t)))

    assert orders() >= 50
    assert orders(min_change_s=2.0) <= 5
