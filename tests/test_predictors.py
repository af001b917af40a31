"""Known-answer and property tests of the orchestrator's predictors: pause model, Continuum TTL, graphs."""

from __future__ import annotations

import math
import subprocess
import sys
from itertools import pairwise

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import (
    ContinuumTTL,
    EmpiricalDistribution,
    ExponentialDistribution,
    PauseModel,
    ProgramGraph,
    ProgramState,
    continuum_tau,
    shared_prefix_steps,
    steps_to_execution,
)
from predictors import LostContextWait

durations = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)


def heavy_tailed_samples(n: int = 2000, seed: int = 7) -> np.ndarray:
    """Lognormal with population mean 0.9 s and sd 3.5 s, like real tool pauses (a long tail)."""
    sigma = math.sqrt(math.log(1.0 + (3.5 / 0.9) ** 2))
    mu = math.log(0.9) - sigma**2 / 2
    return np.random.default_rng(seed).lognormal(mu, sigma, n)


def test_lost_context_wait_is_a_sliding_mean_that_rejects_bad_waits() -> None:
    """Continuum's T (``ContinuumTTL.queue_delay_s``) is this mean over its window."""
    lost = LostContextWait(window=2)
    assert lost.num_waits == 0 and lost.mean_s == 0.0  # nothing measured yet
    lost.observe(9.0)
    lost.observe(5.0)
    assert lost.mean_s == 7.0
    snapshot = lost.copy()
    lost.observe(1.0)  # the oldest leaves the window
    assert lost.num_waits == 2 and lost.mean_s == 3.0 and snapshot.mean_s == 7.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="wait"):
            lost.observe(bad)
    with pytest.raises(ValueError, match="window"):
        LostContextWait(window=0)


# ---- empirical distribution ------------------------------------------------------------------------
def test_ecdf_quantile_mean_of_known_sample() -> None:
    d = EmpiricalDistribution([3.0, 1.0, 10.0, 2.0, 2.0])
    assert [d.ecdf(t) for t in (0.5, 1.0, 2.0, 2.5, 3.0, 10.0, 11.0)] == [0.0, 0.2, 0.6, 0.6, 0.8, 1.0, 1.0]
    assert d.survival(2.0) == pytest.approx(0.4)
    assert [d.quantile(q) for q in (0.0, 0.2, 0.21, 0.6, 0.61, 1.0)] == [1.0, 1.0, 2.0, 2.0, 3.0, 10.0]
    assert d.mean == pytest.approx(3.6)
    assert d.conditional_remaining(2.0) == pytest.approx((3.0 + 10.0) / 2 - 2.0)
    assert list(d.support()) == [1.0, 2.0, 2.0, 3.0, 10.0]
    np.testing.assert_allclose(d.ecdf_array(np.array([2.0, 10.0])), [0.6, 1.0])
    with pytest.raises(ValueError):
        d.quantile(1.5)
    with pytest.raises(ValueError):
        d.observe(-1.0)


def test_reservoir_drops_oldest() -> None:
    d = EmpiricalDistribution([5.0, 1.0, 4.0, 2.0], capacity=3)
    assert list(d.support()) == [1.0, 2.0, 4.0] and d.num_samples == 3


def test_exponential_closed_forms_are_memoryless() -> None:
    e = ExponentialDistribution(2.0)
    assert e.ecdf(2.0) == pytest.approx(1 - math.exp(-1))
    assert e.quantile(0.5) == pytest.approx(2 * math.log(2))
    assert all(e.conditional_remaining(t) == 2.0 for t in (0.0, 1.0, 50.0))
    assert e.conditional(3.0).mean == 2.0
    # An empirical exponential agrees: its remaining pause stays near the mean however long it has run.
    d = EmpiricalDistribution(np.random.default_rng(1).exponential(2.0, 2000))
    for t in (0.0, 1.0, 3.0):
        assert d.conditional_remaining(t) == pytest.approx(2.0, rel=0.1)


def test_uniform_conditional_remaining() -> None:
    grid = EmpiricalDistribution((i + 0.5) / 100 for i in range(1000))  # uniform(0, 10), evenly spaced
    assert grid.conditional_remaining(4.0) == pytest.approx(3.0)
    rnd = EmpiricalDistribution(np.random.default_rng(2).uniform(0, 10, 2000))
    assert rnd.conditional_remaining(4.0) == pytest.approx(3.0, abs=0.1)
    assert rnd.conditional(4.0).mean == pytest.approx(rnd.conditional_remaining(4.0))


def test_heavy_tail_remaining_grows_with_elapsed_time() -> None:
    pm = PauseModel()
    for x in heavy_tailed_samples():
        pm.observe("cd", float(x))
    remaining = [pm.expected_remaining("cd", t) for t in (0.0, 0.5, 1.0, 2.0, 5.0)]
    assert remaining[0] == pytest.approx(pm.distribution("cd").mean)
    assert all(a < b for a, b in pairwise(remaining)), remaining
    # Past the largest sample the extrapolated excess keeps growing (Pareto-like tail).
    top = float(pm.samples("cd")[-1])
    assert pm.expected_remaining("cd", 2 * top) > pm.expected_remaining("cd", top) > 0


@settings(max_examples=50, deadline=None)
@given(st.lists(durations, min_size=1, max_size=40), st.lists(durations, min_size=2, max_size=10))
def test_ecdf_is_monotone_and_bounded(xs: list[float], ts: list[float]) -> None:
    d = EmpiricalDistribution(xs)
    vals = [d.ecdf(t) for t in sorted(ts)]
    assert all(0.0 <= v <= 1.0 for v in vals)
    assert vals == sorted(vals)
    assert d.ecdf(max(xs)) == 1.0


# ---- pause model cold start ------------------------------------------------------------------------
def test_cold_start_fallback_order() -> None:
    pm = PauseModel(min_samples=5, default_mean_s=1.5)
    assert pm.source("a") == "default" and pm.expected_remaining("a", 10.0) == 1.5
    assert len(pm.samples("a")) == 1000  # the default's quantile grid
    for _ in range(4):
        pm.observe("b", 10.0)
    assert pm.source("a") == "default"  # global has 4 < 5
    pm.observe("b", 10.0)
    assert pm.source("a") == "global" and pm.source("b") == "tool"
    assert pm.distribution("a").mean == 10.0
    for _ in range(4):
        pm.observe("a", 2.0)
    assert pm.source("a") == "global"  # own has 4 < 5; global now mixes both tools
    assert pm.distribution("a").mean == pytest.approx((5 * 10.0 + 4 * 2.0) / 9)
    pm.observe("a", 2.0)
    assert pm.source("a") == "tool" and pm.distribution("a").mean == 2.0
    assert list(pm.samples("a")) == [2.0] * 5


# ---- Continuum TTL -----------------------------------------------------------------------------------
@pytest.mark.parametrize("benefit_s", [2.0, 5.0, 20.0])
def test_continuum_exp1_optimum_is_ln_b(benefit_s: float) -> None:
    ttl = ContinuumTTL(PauseModel(), lambda _tokens: benefit_s)  # cold: Exp(1), T = 0, eta = 1
    assert ttl.benefit_s(1000) == benefit_s
    assert ttl.ttl("bash", 1000) == pytest.approx(math.log(benefit_s), rel=0.02)


@pytest.mark.parametrize("benefit_s", [0.0, 0.5, 1.0])
def test_continuum_no_pin_when_benefit_at_most_one_mean(benefit_s: float) -> None:
    assert ContinuumTTL(PauseModel(), lambda _tokens: benefit_s).ttl("bash", 1000) == 0.0


def test_memory_share_prices_a_pin_by_the_share_of_the_pool_it_holds() -> None:
    pool = [6000.0]
    ttl = ContinuumTTL(PauseModel(), lambda _tokens: 0.8, pool_tokens=lambda: pool[0])
    assert ttl.memory_scale(1000) == 6.0 and ttl.benefit_s(1000) == pytest.approx(4.8)
    assert ttl.memory_scale(9000) == 1.0  # a context as large as the pool: Continuum's cost
    # 0.8 s of re-prefill does not pay for a pin of a whole pool (Continuum: tau = 0); of a sixth, it does
    assert ContinuumTTL(PauseModel(), lambda _tokens: 0.8).ttl("bash", 1000) == 0.0
    assert ttl.ttl("bash", 1000) == pytest.approx(math.log(4.8), rel=0.02)
    for unknown in (0.0, math.nan, math.inf):  # a node that reports no pool: Continuum's cost
        pool[0] = unknown
        assert ttl.memory_scale(1000) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(durations, min_size=1, max_size=30), st.floats(min_value=0.0, max_value=1e4))
def test_tau_is_zero_or_a_sample_and_optimal(xs: list[float], benefit_s: float) -> None:
    d = EmpiricalDistribution(xs)
    tau = continuum_tau(d, benefit_s)
    assert tau == 0.0 or tau in xs
    best = max([d.ecdf(0.0) * benefit_s] + [d.ecdf(x) * benefit_s - x for x in xs])
    assert d.ecdf(tau) * benefit_s - tau == pytest.approx(best)


def test_heavy_tail_renewals_stop() -> None:
    pm = PauseModel()
    for x in heavy_tailed_samples():
        pm.observe("cd", float(x))
    ttl = ContinuumTTL(pm, lambda _tokens: 5.0)
    elapsed_s, num_renewals = 0.0, 0
    while (tau := ttl.ttl_remaining("cd", elapsed_s, 1000)) > 0.0:
        elapsed_s += tau
        num_renewals += 1
        assert num_renewals < 100, "a stuck tool kept renewing its pin"
    assert num_renewals >= 1  # the first pins pay, then the tail makes them stop
    assert elapsed_s < float(pm.samples("cd")[-1])
    # Past all samples, the extrapolated excess is large: no pin at all.
    assert ttl.ttl_remaining("cd", 10 * float(pm.samples("cd")[-1]), 1000) == 0.0


def test_eta_from_finished_programs() -> None:
    ttl = ContinuumTTL(PauseModel(), lambda _tokens: 0.0, min_programs=3)
    ttl.observe_program_finished(8)
    ttl.observe_program_finished(8)
    assert ttl.eta == 1.0  # too few programs yet
    for _ in range(20):
        ttl.observe_program_finished(8)  # N fixed: k and N - k perfectly anti-correlated
    assert ttl.eta == pytest.approx(1.0)
    mixed = ContinuumTTL(PauseModel(), lambda _tokens: 0.0, min_programs=1)
    ns = [int(n) for n in np.random.default_rng(3).geometric(0.2, 200)]
    for n in ns:
        mixed.observe_program_finished(n)
    k = np.concatenate([np.arange(1, n + 1) for n in ns])
    r = np.concatenate([n - np.arange(1, n + 1) for n in ns])
    assert mixed.eta == pytest.approx(min(max(-np.corrcoef(k, r)[0, 1], 0.0), 1.0))


def test_queue_delay_is_a_sliding_mean() -> None:
    ttl = ContinuumTTL(PauseModel(), lambda tokens: tokens / 1000, queue_window=3)
    assert ttl.queue_delay_s == 0.0
    for d in (1.0, 2.0, 3.0):
        ttl.observe_evicted_queue_delay(d)
    assert ttl.queue_delay_s == pytest.approx(2.0)
    ttl.observe_evicted_queue_delay(10.0)
    assert ttl.queue_delay_s == pytest.approx(5.0)
    assert ttl.benefit_s(2000) == pytest.approx(5.0 * 1.0 + 2.0)


# ---- KVFlow steps-to-execution -----------------------------------------------------------------------
def diamond() -> nx.DiGraph:
    """A -> B -> D and A -> C -> E -> D: D joins a short and a long branch."""
    return nx.DiGraph([("A", "B"), ("A", "C"), ("C", "E"), ("B", "D"), ("E", "D")])


def test_kvflow_diamond_and_or_joins() -> None:
    g = diamond()
    assert steps_to_execution(g, {"A"}) == {"A": 0, "B": 1, "C": 1, "E": 2, "D": 3}
    assert steps_to_execution(g, {"A"}, {"D": "or"})["D"] == 2
    # B running, A finished: C is ready (1), E behind it (2); D waits for E (AND) or fires after B (OR).
    v = steps_to_execution(g, {"B"}, finished={"A"})
    assert v == {"A": math.inf, "B": 0, "C": 1, "E": 2, "D": 3}
    assert steps_to_execution(g, {"B"}, {"D": "or"}, finished={"A"})["D"] == 1
    assert steps_to_execution(g, set())["A"] == 1  # a source waiting to start
    assert shared_prefix_steps(v, {"sys": ["D", "E"], "tools": ["B", "D"], "none": []}) == {
        "sys": 2,
        "tools": 0,
        "none": math.inf,
    }


def test_kvflow_rejects_cycles_and_bad_input() -> None:
    g = nx.DiGraph([("A", "B"), ("B", "C"), ("C", "A"), ("C", "D")])
    with pytest.raises(ValueError, match=r"'[ABC]' lies on a cycle"):
        steps_to_execution(g, {"A"})
    with pytest.raises(ValueError, match="not in the graph"):
        steps_to_execution(diamond(), {"Z"})
    with pytest.raises(ValueError, match="join kinds"):
        steps_to_execution(diamond(), {"A"}, {"D": "xor"})  # type: ignore[dict-item]


# ---- program graph and live state --------------------------------------------------------------------
def test_markov_next_step_probabilities() -> None:
    pg = ProgramGraph("coder")
    for _ in range(3):
        pg.observe_transition("llm:main", "tool:bash", 1.0)
    pg.observe_transition("llm:main", "human", 4.0)
    assert pg.next_step_probabilities("llm:main") == {"tool:bash": 0.75, "human": 0.25}
    assert pg.most_likely_next("llm:main") == "tool:bash"
    assert pg.most_likely_next("tool:bash") is None and pg.next_step_probabilities("nope") == {}
    assert pg.mean_duration_s("llm:main", "human") == 4.0
    main = pg.step_durations("llm:main")
    assert main is not None and main.mean == 1.75


def planner_coder_graph() -> ProgramGraph:
    """planner -> bash -> coder -> planner, with a rarer shortcut bash -> planner."""
    pg = ProgramGraph("plan-code")
    for _ in range(4):
        pg.observe_transition("llm:planner", "tool:bash", 1.0)
        pg.observe_transition("tool:bash", "llm:coder", 2.0)
        pg.observe_transition("llm:coder", "llm:planner", 3.0)
    pg.observe_transition("tool:bash", "llm:planner", 2.0)
    return pg


def test_predict_next_use_follows_most_likely_path() -> None:
    pg = planner_coder_graph()
    state = ProgramState("p1", pg, learn=False)
    state.start_step("llm:planner", 0.0, session_id="P")
    state.start_step("tool:bash", 1.0)
    state.start_step("llm:coder", 3.0, session_id="C")
    state.start_step("llm:reviewer", 6.0, session_id="R")  # never seen in the graph
    state.start_step("llm:planner", 6.5, session_id="P")
    assert state.predict_next_use(PauseModel(), 6.6)["P"] == 0.0  # its turn is running
    state.start_step("tool:bash", 7.0)
    pred = state.predict_next_use(PauseModel(), 7.5)  # cold pause model: bash has 1.0 s left
    # C: bash -> coder, so the tool's remaining pause. P: bash -> coder -> planner (p = 0.8) beats the
    # shortcut bash -> planner (p = 0.2): remaining 1.0 + coder's mean 3.0. R: no path, recency 7.5 - 6.5.
    assert pred == pytest.approx({"C": 1.0, "P": 4.0, "R": 1.0})
    slow = PauseModel(min_samples=50)
    for x in heavy_tailed_samples():
        slow.observe("bash", float(x))
    early, late = (state.predict_next_use(slow, t)["C"] for t in (7.0, 9.0))
    assert late > early  # a heavy-tailed tool that has run longer is expected to run longer still


def test_program_state_learns_transitions() -> None:
    pg = ProgramGraph("loop")
    state = ProgramState("p2", pg)
    t = 0.0
    for _ in range(3):
        state.start_step("llm:main", t, session_id="S")
        state.end_turn("S", t + 1.0)
        state.start_step("tool:bash", t + 1.0)
        t += 3.0
    assert pg.num_transitions("llm:main", "tool:bash") == 3
    assert pg.num_transitions("tool:bash", "llm:main") == 2
    assert pg.mean_duration_s("tool:bash", "llm:main") == 2.0
    assert state.last_turn_end_s == {"S": 7.0}
    pred = state.predict_next_use(PauseModel(default_mean_s=0.5), 7.2)
    assert pred == {"S": 0.5}


def test_policy_core_imports_no_runtime_or_engine() -> None:
    code = (
        "import sys, orchestrator; "
        "bad = [m for m in ('temporalio', 'grpc', 'torch', 'engine_adapter') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_host_hit_share_weighs_tokens_forgets_slowly_and_ignores_device_hits() -> None:
    from predictors import HostHitShare

    share = HostHitShare()
    assert share.fraction() == 1.0  # a host tier is taken to work until a miss is seen
    share.observe(2000, 500, 1500)  # all that left the device came back from the host
    assert share.fraction() == 1.0
    share.observe(2000, 2000, 0)  # all on the device: says nothing about the host
    assert share.num_observed == 1
    share.observe(1000, 0, 0)  # a small context lost: token-weighted
    assert share.fraction() == pytest.approx(1500 * 0.98 / (1500 * 0.98 + 1000))
    for _ in range(300):
        share.observe(1000, 0, 0)
    assert share.fraction() < 0.01  # the past fades
    with pytest.raises(ValueError, match="decay"):
        HostHitShare(decay=1.0)


def test_prefill_share_splits_steps_by_what_a_decode_step_alone_lasts() -> None:
    from predictors import PrefillShare, UnpinnedSurvival

    share = PrefillShare(decay=0.5)
    assert share.fraction() == 0.0  # nothing seen: no claim
    share.observe(0, 4, 0.01)  # decodes alone: 10 ms
    share.observe(500, 4, 0.06)  # mixed: 50 ms of it prefill
    assert share.fraction() == pytest.approx((0.05) / (0.5 * 0.01 + 0.06))
    share.observe(300, 0, 0.03)  # no decodes: all prefill
    assert share.fraction() == pytest.approx((0.5 * 0.05 + 0.03) / (0.25 * 0.01 + 0.5 * 0.06 + 0.03))
    before = share.fraction()
    for bad in (0.0, -1.0, math.nan, math.inf):
        share.observe(100, 1, bad)  # a step with no measurable time says nothing
    share.observe(0, 0, 1.0)  # ... nor one that ran nothing
    assert share.fraction() == before
    with pytest.raises(ValueError, match="decay"):
        PrefillShare(decay=1.0)

    keep = UnpinnedSurvival(decay=0.5)
    assert keep.fraction() == 0.0  # taken as lost until one is seen to survive
    keep.observe(1000, 600)
    keep.observe(0, 0)  # a first turn: no history, nothing to say
    keep.observe(1000, 5000)  # a hit longer than the history counts as all of it
    assert keep.fraction() == pytest.approx((0.5 * 600 + 1000) / (0.5 * 1000 + 1000))
    assert keep.num_observed == 2
    # over the whole run, undecayed (a replay's report gives this one): the early 60% weighs as much as the 100%
    assert keep.run_fraction() == pytest.approx((600 + 1000) / 2000)
    assert UnpinnedSurvival().run_fraction() == 0.0  # the default before any is seen, as fraction()


def test_measured_price_caps_the_prefill_share_and_ignores_bad_readings() -> None:
    model = PauseModel(min_samples=1)
    reading = {"p": 1.0, "s": 0.0}
    ttl = ContinuumTTL(model, lambda n: 1e-3 * n, pool_tokens=lambda: 2000.0,
                       prefill_share=lambda: reading["p"], unpinned_survival=lambda: reading["s"])
    ttl.observe_evicted_queue_delay(100.0)
    assert ttl.benefit_s(1000) == pytest.approx(1.0 * (0.95 / 0.05) * 2.0)  # p read at most 0.95
    reading.update(p=math.nan, s=math.nan)  # a broken reading prices as none: the memory-share price
    assert ttl.benefit_s(1000) == pytest.approx(1.0 * 2.0)
    reading.update(p=0.2, s=1.0)  # every unpinned context survives: a pin saves nothing
    assert ttl.benefit_s(1000) == 0.0
    assert ttl.ttl("t", 1000) == 0.0


def test_host_tier_prices_the_lost_share_by_t_and_refuses_a_measured_price() -> None:
    """A host tier that gives back h of an evicted context: that share is priced by its copy back, the rest
    as a lost context, by T and the re-prefill; the measured price's reading is ContinuumTTL's, refused here
    (a price silently not used would be a trap)."""
    from predictors import HostTierTTL

    model = PauseModel(min_samples=1)
    kw: dict = {"miss_reload": lambda n: 1e-3 * n, "host_hit_fraction": lambda: 0.25}
    ttl = HostTierTTL(model, lambda n: 1e-5 * n, **kw)
    for _ in range(3):
        ttl.observe_evicted_queue_delay(20.0)
    assert ttl.benefit_s(1000) == pytest.approx(0.25 * 0.01 + 0.75 * (20.0 + 1.0))
    with pytest.raises(ValueError, match="prefill_share is ContinuumTTL's"):
        HostTierTTL(model, lambda n: 1e-5 * n, prefill_share=lambda: 0.8, **kw)
