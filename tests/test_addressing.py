"""``orchestrator.hints_by_node``: which node each hint goes to, the one rule of the live runtime and the
replay."""

from __future__ import annotations

from hints import EvictionOrder, NextUse, Pin, Priority, Release
from orchestrator import hints_by_node

NODES = ["a", "b", "c"]
HOME = {"s1": "a", "s2": "b"}


def test_hints_follow_their_session_release_goes_everywhere_unknown_sessions_too() -> None:
    pin1, pin2 = Pin(session_id="s1", ttl_s=5.0), Pin(session_id="s2", ttl_s=1.0)
    prio = Priority(session_id="s9", program_id="p", program_age_s=1.0)  # no turn placed it yet
    rel = Release(program_id="p")
    out = hints_by_node([pin1, prio, pin2, rel], HOME.get, NODES)
    assert out == {"a": [pin1, prio, rel], "b": [prio, pin2, rel], "c": [prio, rel]}


def test_an_eviction_order_is_split_by_its_entries_sessions() -> None:
    e1, e2, e9 = (NextUse(session_id=s, next_use_s=t) for s, t in (("s1", 1.0), ("s2", 2.0), ("s9", 3.0)))
    out = hints_by_node([EvictionOrder(entries=[e1, e2, e9])], HOME.get, NODES)
    assert out == {
        "a": [EvictionOrder(entries=[e1, e9])],
        "b": [EvictionOrder(entries=[e2, e9])],
        "c": [EvictionOrder(entries=[e9])],
    }


def test_nothing_to_send_is_no_batch() -> None:
    assert hints_by_node([], HOME.get, NODES) == {}
