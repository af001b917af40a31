"""The runtime prices pins by the host copy once every engine's CacheState shows a host tier (no server:
``note_host_tier`` is what the cache-state watch calls with each state)."""

from __future__ import annotations

from workflows._runtime import HintRuntime


def test_pins_are_priced_by_the_copy_only_when_every_engine_has_a_host_tier() -> None:
    rt = HintRuntime(["127.0.0.1:1", "127.0.0.1:2"])
    policy = rt.policy
    assert policy.host_reload is None  # type: ignore[attr-defined]
    rt.note_host_tier("127.0.0.1:1", True)
    assert policy.host_reload is None  # type: ignore[attr-defined]  # the other engine has not said
    rt.note_host_tier("127.0.0.1:2", True)
    reload = policy.host_reload  # type: ignore[attr-defined]
    assert reload is not None and reload(1000) == rt.router.host_reload_s_per_token * 1000
    rt.note_host_tier("127.0.0.1:2", False)  # restarted without one
    assert policy.host_reload is None  # type: ignore[attr-defined]


def test_a_policy_object_passed_in_is_left_as_configured() -> None:
    from orchestrator._policy import get_policy

    mine = get_policy("hintflow")
    rt = HintRuntime(["127.0.0.1:1"], policy=mine)
    rt.note_host_tier("127.0.0.1:1", True)
    assert mine.host_reload is None  # type: ignore[attr-defined]
