"""The router across engine nodes: warm versus cold priced in seconds, pending turns, and the baselines."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from hints import CacheState, SessionResidency
from orchestrator import (
    ROUTING_POLICIES,
    NoNodeAvailable,
    Router,
    RouteRequest,
    default_prefill_s,
    get_routing_policy,
)


def state(
    node_id: str = "n",
    *,
    sessions: tuple[SessionResidency, ...] = (),
    backlog: int = 0,
    waiting: int = 0,
    running: int = 0,
    version: int = 1,
    free_blocks: int = 1000,
    epoch: int = 0,
) -> CacheState:
    return CacheState(
        node_id=node_id,
        model_name="m",
        block_size=16,
        total_blocks=1000,
        free_blocks=free_blocks,
        pinned_blocks=0,
        host_total_blocks=0,
        host_free_blocks=0,
        num_waiting=waiting,
        num_running=running,
        prefill_backlog_tokens=backlog,
        sessions=list(sessions),
        version=version,
        node_epoch=epoch,
    )


def resident(session_id: str, device: int = 0, host: int = 0) -> SessionResidency:
    return SessionResidency(session_id=session_id, device_tokens=device, host_tokens=host, state="parked")


def linear(n: int, p: int) -> float:
    """1 ms per new token, blind to the cached prefix: makes expected seconds easy to check by hand."""
    return 1e-3 * n


def two_nodes(router: Router, a: CacheState | None = None, b: CacheState | None = None) -> Router:
    router.update("a", a or state("na"), now_s=0.0)
    router.update("b", b or state("nb"), now_s=0.0)
    return router


def test_warm_node_chosen_when_its_backlog_is_small() -> None:
    router = two_nodes(
        Router(), a=state("na", sessions=(resident("s", device=8000),), backlog=1000, waiting=1)
    )
    d = router.choose(RouteRequest("s", "p", context_tokens=8200), now_s=0.0)
    assert (d.address, d.reason, d.warm_tokens) == ("a", "warm", 8000)
    assert d.expected_s["a"] < d.expected_s["b"]
    assert d.moved_from is None and d.notes == ()


def test_cold_node_chosen_when_warm_wait_exceeds_recompute() -> None:
    busy = state("na", sessions=(resident("s", device=8000),), backlog=40_000, waiting=10, running=3)
    router = two_nodes(Router(), a=busy)
    d = router.choose(RouteRequest("s", "p", context_tokens=8200), now_s=0.0)
    assert (d.address, d.reason, d.warm_tokens) == ("b", "cold-cheaper", 0)
    # backlog priced as 10 requests of 4000 tokens, not one 40k prompt (the quadratic term would triple it)
    expected_wait_s = 10 * default_prefill_s(4000, 0) + 3 * router.decode_s_per_running_seq
    assert d.expected_s["a"] == pytest.approx(expected_wait_s + default_prefill_s(200, 8000))
    assert d.expected_s["b"] == pytest.approx(default_prefill_s(8200, 0))


def test_a_session_stays_home_unless_another_node_is_twice_as_fast() -> None:
    req = RouteRequest("s", "p", context_tokens=1100)
    for backlog, expected in ((1400, ("a", "warm-home")), (2900, ("b", "cold-cheaper"))):
        home = state("na", sessions=(resident("s", device=1000),), backlog=backlog, waiting=1)
        router = two_nodes(Router(linear), a=home)
        router.started("a", req)
        router.finished("a", "s")
        d = router.choose(req, now_s=0.0)
        assert d.expected_s["b"] == pytest.approx(1.1) and d.expected_s["a"] == pytest.approx(backlog * 1e-3)
        assert (d.address, d.reason) == expected  # cheaper elsewhere both times: only the margin decides
        assert d.moved_from == (None if d.address == "a" else "a")


def test_cost_formula_by_hand() -> None:
    router = two_nodes(
        Router(linear, decode_s_per_running_seq=0.01),
        a=state("na", sessions=(resident("s", device=300),), backlog=500, waiting=2, running=4),
    )
    d = router.choose(RouteRequest("s", "p", context_tokens=1000), now_s=0.0)
    assert d.expected_s == pytest.approx({"a": 0.5 + 0.04 + 0.7, "b": 1.0})


def test_host_resident_tokens_are_warm_but_pay_the_reload() -> None:
    a = state("na", sessions=(resident("s", device=1000, host=7000),))
    cheap = two_nodes(Router(linear, host_reload_s_per_token=1e-5), a=a)
    d = cheap.choose(RouteRequest("s", "p", context_tokens=8500), now_s=0.0)
    assert (d.address, d.warm_tokens) == ("a", 8000)
    assert d.expected_s["a"] == pytest.approx(0.5 + 7000 * 1e-5)
    dear = two_nodes(Router(linear, host_reload_s_per_token=2e-3), a=a)
    d = dear.choose(RouteRequest("s", "p", context_tokens=8500), now_s=0.0)
    assert (d.address, d.reason) == ("b", "cold-cheaper")
    assert d.expected_s["a"] == pytest.approx(0.5 + 14.0)


def test_ties_go_to_the_shorter_wait_then_the_address() -> None:
    router = two_nodes(Router(linear), a=state("na", sessions=(resident("s", device=100),), backlog=100))
    d = router.choose(RouteRequest("s", "p", context_tokens=100), now_s=0.0)
    assert d.expected_s["a"] == d.expected_s["b"]
    assert d.address == "b"  # same cost, shorter wait
    d = two_nodes(Router(linear)).choose(RouteRequest("t", "p", context_tokens=100), now_s=0.0)
    assert d.address == "a" and d.reason == "cold"


def route_many(router: Router, num_sessions: int, context_tokens: int, prefix_tokens: int) -> Counter[str]:
    """Route and start ``num_sessions`` sessions sharing one prefix, with no state update in between."""
    placed: Counter[str] = Counter()
    for i in range(num_sessions):
        req = RouteRequest(f"s{i}", "p", context_tokens, prefix_key="sys", prefix_tokens=prefix_tokens)
        d = router.choose(req, now_s=1.0)
        router.started(d.address, req)
        placed[d.address] += 1
    return placed


def test_hot_shared_prefix_spreads_over_nodes_between_state_updates() -> None:
    placed = route_many(two_nodes(Router()), 50, context_tokens=2500, prefix_tokens=2000)
    assert set(placed) == {"a", "b"}
    assert min(placed.values()) >= 20, placed


def warm_prefix_router(prefix_tokens: int) -> Router:
    """Node a has seen the prefix, and a newer state has since absorbed that first turn."""
    router = two_nodes(Router())
    req = RouteRequest("first", "p", prefix_tokens, prefix_key="sys", prefix_tokens=prefix_tokens)
    router.started(router.choose(req, now_s=0.0).address, req)
    two_nodes(router, a=state("na", version=2), b=state("nb", version=2))
    return router


def test_hot_prefix_stays_on_the_warm_node_while_suffixes_are_cheap() -> None:
    router = warm_prefix_router(8000)
    assert route_many(router, 20, context_tokens=8020, prefix_tokens=8000) == Counter({"a": 20})


def test_hot_prefix_spills_once_pending_work_outweighs_the_recompute() -> None:
    router = warm_prefix_router(8000)
    placed = route_many(router, 50, context_tokens=10_000, prefix_tokens=8000)
    assert placed["a"] >= 1 and placed["b"] >= 1, placed
    assert max(placed.values()) <= 40, placed


def test_pending_turns_dropped_at_finish_or_by_a_later_version() -> None:
    router = two_nodes(Router(linear))
    req = RouteRequest("s", "p", context_tokens=1000)
    other = RouteRequest("t", "p", context_tokens=1000)  # sees a's queue, not s's context
    baseline = router.choose(other, now_s=0.0).expected_s["a"]
    router.started("a", req)
    assert router.choose(other, now_s=0.0).expected_s["a"] > baseline
    router.finished("a", "s")
    assert router.choose(other, now_s=0.0).expected_s["a"] == baseline
    router.started("a", req)
    router.update("a", state("na", version=1), now_s=0.0)  # same version: the turn is not in it yet
    assert router.choose(other, now_s=0.0).expected_s["a"] > baseline
    router.update("a", state("na", version=2), now_s=0.0)
    assert router.choose(other, now_s=0.0).expected_s["a"] == baseline


def test_a_session_stays_warm_where_it_just_ran_until_a_newer_state_says_otherwise() -> None:
    # The last state from "a" was taken before the session's turn ended there, so it cannot list the
    # context the turn left; without this rule both nodes look cold and the less loaded one wins.
    router = two_nodes(Router(linear), b=state("nb", version=1))
    req = RouteRequest("s", "p", context_tokens=4000)
    router.started("a", req)
    router.update("a", state("na", version=2, running=3), now_s=0.0)  # the turn is running in it
    router.finished("a", "s")
    d = router.choose(RouteRequest("s", "p", context_tokens=4200), now_s=0.1)
    assert (d.address, d.warm_tokens, d.moved_from) == ("a", 4000, None)
    router.update("a", state("na", version=3, running=3), now_s=0.2)  # newer, and the session is gone
    d = router.choose(RouteRequest("s", "p", context_tokens=4200), now_s=0.2)
    assert d.warm_tokens == 0 and (d.address, d.moved_from) == ("b", "a")


def test_retry_elsewhere_moves_the_pending_turn() -> None:
    router = two_nodes(Router(linear))
    req = RouteRequest("s", "p", context_tokens=1000)
    router.started("a", req)
    router.started("b", req)
    d = router.choose(RouteRequest("t", "p", context_tokens=1000), now_s=0.0)
    assert d.expected_s["a"] == pytest.approx(1.0) and d.expected_s["b"] > 1.0


def test_removed_node_is_never_chosen() -> None:
    router = two_nodes(Router(), a=state("na", sessions=(resident("s", device=8000),)))
    router.remove("a")
    for _ in range(3):
        d = router.choose(RouteRequest("s", "p", context_tokens=8000), now_s=0.0)
        assert (d.address, d.reason) == ("b", "only-node")
        assert set(d.expected_s) == {"b"}
    router.started("a", RouteRequest("s", "p", context_tokens=8000))  # a race with removal: no error
    assert router.choose(RouteRequest("s", "p", context_tokens=8000), now_s=0.0).address == "b"


def test_no_node_available_says_why() -> None:
    with pytest.raises(NoNodeAvailable, match=r"session 's'.*known none"):
        Router().choose(RouteRequest("s", "p", context_tokens=1), now_s=0.0)
    router = two_nodes(Router())
    with pytest.raises(RuntimeError, match=r"known \['a', 'b'\], excluded \['a', 'b'\]"):
        router.choose(RouteRequest("s", "p", context_tokens=1), now_s=0.0, exclude={"a", "b"})
    assert router.choose(RouteRequest("s", "p", context_tokens=1), now_s=0.0, exclude={"a"}).address == "b"


def test_moved_from_names_the_node_the_session_left() -> None:
    router = two_nodes(Router(linear))
    req = RouteRequest("s", "p", context_tokens=1000)
    router.started("a", req)
    router.update("a", state("na", backlog=50_000, waiting=1, version=2), now_s=0.0)
    d = router.choose(req, now_s=0.0)
    assert (d.address, d.moved_from) == ("b", "a")
    router.started("b", req)
    assert router.choose(RouteRequest("s", "p", context_tokens=1000), now_s=0.0).moved_from is None


def test_stale_state_still_routes_with_a_note() -> None:
    router = Router(stale_after_s=5.0)
    router.update("a", state("na"), now_s=0.0)
    router.update("b", state("nb"), now_s=9.0)
    d = router.choose(RouteRequest("s", "p", context_tokens=10), now_s=10.0)
    assert d.address == "a"
    assert d.notes == ("state of a is 10.0 s old",)


@pytest.mark.parametrize("restart", ["version went back", "new node_id", "new epoch"])
def test_node_restart_forgets_prefix_affinity(restart: str) -> None:
    router = warm_prefix_router(4000)
    req = RouteRequest("s", "p", context_tokens=4100, prefix_key="sys", prefix_tokens=4000)
    d = router.choose(req, now_s=0.0)
    assert (d.address, d.warm_tokens) == ("a", 4000)
    router.started("a", req)
    new_state = {"version went back": state("na", version=1), "new node_id": state("na-2", version=5),
                 "new epoch": state("na", version=5, epoch=9)}[restart]  # fmt: skip
    router.update("a", new_state, now_s=0.0)
    d = router.choose(req, now_s=0.0)
    assert d.warm_tokens == 0 and d.expected_s["a"] == d.expected_s["b"]  # also no pending left on a
    assert router.node_epoch("a") == new_state.node_epoch  # the life a pin acked there is checked against
    router.remove("a")
    assert router.node_epoch("a") is None


def test_remove_forgets_prefix_affinity_for_a_node_that_comes_back() -> None:
    router = warm_prefix_router(4000)
    router.remove("a")
    router.update("a", state("na", version=3), now_s=0.0)
    req = RouteRequest("s", "p", context_tokens=4100, prefix_key="sys", prefix_tokens=4000)
    assert router.choose(req, now_s=0.0).warm_tokens == 0


def test_a_restarted_node_is_not_assumed_to_hold_the_context_a_session_left_there() -> None:
    router = Router()
    router.update("a", state("na", version=500), now_s=0.0)
    router.update("b", state("nb", version=10), now_s=0.0)
    req = RouteRequest("s", "p", context_tokens=4000)
    router.started("a", req)
    router.finished("a", "s")
    assert router.choose(RouteRequest("s", "p", context_tokens=4100), now_s=0.0).warm_tokens == 4000
    router.remove("a")  # it went away and came back empty: a new node id, its version from 0
    router.update("a", state("na-2", version=3), now_s=1.0)
    d = router.choose(RouteRequest("s", "p", context_tokens=4100), now_s=1.0)
    assert d.warm_tokens == 0 and d.expected_s["a"] == d.expected_s["b"]


def test_round_robin_alternates_blind_to_warmth() -> None:
    router = two_nodes(Router(policy="round-robin"), a=state("na", sessions=(resident("s", device=9000),)))
    picks = [router.choose(RouteRequest("s", "p", context_tokens=9000), now_s=0.0) for _ in range(4)]
    assert [d.address for d in picks] == ["a", "b", "a", "b"]
    assert {d.reason for d in picks} == {"round-robin"}


def test_session_affinity_sticks_even_when_loaded() -> None:
    router = two_nodes(Router(policy="session"))
    d = router.choose(RouteRequest("s", "p", context_tokens=100), now_s=0.0)
    assert (d.address, d.reason) == ("a", "least-loaded")
    router.started("a", RouteRequest("s", "p", context_tokens=100))
    router.update("a", state("na", backlog=100_000, waiting=5, version=2), now_s=0.0)
    d = router.choose(RouteRequest("s", "p", context_tokens=100), now_s=0.0)
    assert (d.address, d.reason) == ("a", "sticky")
    assert router.choose(RouteRequest("t", "p", context_tokens=100), now_s=0.0).address == "b"


def test_llmd_prefers_the_prefix_warm_node_despite_load() -> None:
    a = state("na", sessions=(resident("s", device=9000),), waiting=4, running=4, free_blocks=200)
    router = two_nodes(Router(policy="llm-d"), a=a, b=state("nb", running=1))
    d = router.choose(RouteRequest("s", "p", context_tokens=10_000), now_s=0.0)
    # a: 2*0.9 + (1-0.8) + (1-8/8) = 2.0;  b: 0 + 1 + (1-1/8) = 1.875
    assert (d.address, d.reason, d.warm_tokens) == ("a", "llm-d", 9000)
    d = router.choose(RouteRequest("t", "p", context_tokens=10_000), now_s=0.0)
    assert d.address == "b"  # nothing warm: emptier cache and shorter queue win


def test_registry_and_unknown_policy() -> None:
    assert set(ROUTING_POLICIES) == {"hintflow", "round-robin", "session", "llm-d"}
    for name in ROUTING_POLICIES:
        assert get_routing_policy(name).name == name
    with pytest.raises(
        ValueError, match=r"unknown routing policy 'lru'; known: hintflow, llm-d, round-robin"
    ):
        Router(policy="lru")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"context_tokens": -1}, "context_tokens must be >= 0"),
        ({"context_tokens": 10, "prefix_key": "k", "prefix_tokens": 11}, "prefix_tokens <= context_tokens"),
        ({"context_tokens": 10, "prefix_tokens": 5}, "needs a prefix_key"),
        ({"context_tokens": 10, "session_id": ""}, "session_id must not be empty"),
    ],
)
def test_bad_request_raises_clearly(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RouteRequest(**{"session_id": "s", "program_id": "p", **kwargs})


def test_bad_router_knobs_and_cost_model_raise() -> None:
    with pytest.raises(ValueError, match=r"host_reload_s_per_token must be finite and >= 0, got -1\.0"):
        Router(host_reload_s_per_token=-1.0)
    with pytest.raises(ValueError, match="stale_after_s"):
        Router(stale_after_s=math.nan)
    router = two_nodes(Router(lambda n, p: math.nan))
    with pytest.raises(ValueError, match=r"prefill_s\(10, 0\) must be finite and >= 0, got nan"):
        router.choose(RouteRequest("s", "p", context_tokens=10), now_s=0.0)
    with pytest.raises(ValueError, match="non-empty node address"):
        router.update("", state(), now_s=0.0)


def test_default_prefill_prices_attention_over_the_cached_prefix() -> None:
    assert default_prefill_s(0, 5000) == 0.0
    assert default_prefill_s(1000, 8000) > default_prefill_s(1000, 0) > 0.0
    # chunking telescopes: two halves cost the one-shot prefill
    assert default_prefill_s(500, 0) + default_prefill_s(500, 500) == pytest.approx(
        default_prefill_s(1000, 0)
    )
    with pytest.raises(ValueError, match="non-negative"):
        default_prefill_s(-1, 0)


def test_placements_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import orchestrator._router as r

    monkeypatch.setattr(r, "MAX_SESSIONS", 3)
    router = two_nodes(Router(linear))
    for i in range(5):
        router.started("a", RouteRequest(f"s{i}", "p", context_tokens=100))
    router.started("a", RouteRequest("s2", "p", context_tokens=100))  # recent again: kept
    router.started("a", RouteRequest("s5", "p", context_tokens=100))
    assert list(router._session_node) == ["s4", "s2", "s5"]
    assert set(router._session_ctx) == {"s4", "s2", "s5"}
