"""The runtime prices pins by the host copy once every engine's CacheState shows a host tier (no server:
``note_node_state`` is what the cache-state watch calls with each state; the rule is ``ControlCore.node_seen``)."""

from __future__ import annotations

import pytest

from workflows import HintRuntime


def test_pins_are_priced_by_the_copy_only_when_every_engine_has_a_host_tier() -> None:
    rt = HintRuntime(["127.0.0.1:1", "127.0.0.1:2"])
    policy = rt.policy
    assert policy.host_reload is None  # type: ignore[attr-defined]
    rt.note_node_state("127.0.0.1:1", True, 1000)
    assert policy.host_reload is None  # type: ignore[attr-defined]  # the other engine has not said
    rt.note_node_state("127.0.0.1:2", True, 1000)
    reload = policy.host_reload  # type: ignore[attr-defined]
    assert reload is not None and reload(1000) == rt.router.host_reload_s_per_token * 1000
    # ... and by what the tiers give back, as the nodes measure it (the watch keeps it per node)
    hit = policy.host_hit_fraction  # type: ignore[attr-defined]
    assert hit is not None and hit() == 1.0  # no node has said yet: a host tier is taken to work
    rt.note_node_state("127.0.0.1:1", True, 1000, 0.2)
    rt.note_node_state("127.0.0.1:2", True, 1000, 0.6)
    assert hit() == pytest.approx(0.4)
    rt.note_node_state("127.0.0.1:2", False, 1000)  # restarted without one
    assert policy.host_reload is None and policy.host_hit_fraction is None  # type: ignore[attr-defined]


def test_a_policy_object_passed_in_is_left_as_configured() -> None:
    from orchestrator import get_policy

    mine = get_policy("hintflow")
    rt = HintRuntime(["127.0.0.1:1"], policy=mine)
    rt.note_node_state("127.0.0.1:1", True, 1000)
    assert mine.host_reload is None  # type: ignore[attr-defined]


def _state(node_id: str, host_reload_s_per_token: float, on_host: str = ""):  # type: ignore[no-untyped-def]
    from hints import CacheState, SessionResidency

    sessions = [SessionResidency(session_id=on_host, program_id="p", device_tokens=0, host_tokens=1600,
                                 pinned=False, state="parked")] if on_host else []
    return CacheState(node_id=node_id, model_name="m", block_size=16, total_blocks=10, free_blocks=10,
                      pinned_blocks=0, host_total_blocks=200, host_free_blocks=100, num_waiting=0, num_running=0,
                      prefill_backlog_tokens=0, sessions=sessions, host_reload_s_per_token=host_reload_s_per_token)


def test_pins_and_routes_use_each_node_s_own_reload_cost_once_it_reports_one() -> None:
    """A node's CacheState carries its copy-back cost (a torch node measures it): the router prices a
    context on that node's host by it, and the pins by the slowest node's, read at each decision."""
    from orchestrator import RouteRequest

    a, b = "127.0.0.1:1", "127.0.0.1:2"
    rt = HintRuntime([a, b])
    rt.note_node_state(a, True, 1000)
    rt.note_node_state(b, True, 1000)
    reload = rt.policy.host_reload  # type: ignore[attr-defined]
    default = rt.router.host_reload_s_per_token
    rt.router.update(a, _state("na", 0.0), 0.0)  # reports none yet: the router's default
    rt.router.update(b, _state("nb", 3e-5), 0.0)
    assert rt.router.host_reload_s(a) == default and rt.router.host_reload_s(b) == 3e-5
    assert reload(1000) == max(default, 3e-5) * 1000
    rt.router.update(a, _state("na", 5e-5), 0.0)  # measured later: taken at the next decision
    assert reload(1000) == 5e-5 * 1000
    rt.router.update(b, _state("nb", 1e-6), 1.0)
    assert reload(1000) == 5e-5 * 1000  # the slowest node's
    # routing: the same context on host at either node costs each node's own copy back
    rt.router.update(a, _state("na", 5e-5, on_host="p/s"), 2.0)
    rt.router.update(b, _state("nb", 1e-6, on_host="p/s"), 2.0)
    req = RouteRequest("p/s", "p", 1600)
    va, vb = rt.router._view(a, req), rt.router._view(b, req)
    assert va.host_tokens == vb.host_tokens == 1600
    assert va.cost_s - vb.cost_s == pytest.approx((5e-5 - 1e-6) * 1600)


def test_pins_on_nodes_without_a_host_tier_are_priced_by_the_nodes_readings() -> None:
    """The measured price reads each node's CacheState prefill share and unpinned survival (their mean)."""
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    rt = HintRuntime([a, b])
    rt.note_node_state(a, False, 4000, 0.0, 0, 0.9, 0.2)
    rt.note_node_state(b, False, 4000, 0.0, 0, 0.7, 0.4)
    ttl = rt.policy.ttl  # type: ignore[attr-defined]
    reload_s = ttl.prefill_reload(1000)
    assert ttl.benefit_s(1000) == pytest.approx(reload_s * (1 - 0.3) * (0.8 / 0.2) * 4.0)
    rt.note_node_state(a, False, 4000, 0.0, 0, 0.1, 0.0)  # a node that now mostly decodes
    assert ttl.benefit_s(1000) == pytest.approx(reload_s * (1 - 0.2) * 1.0 * 4.0)
