"""engine_adapter._fcfs_bound: a waiting turn falls due once the node has computed, since it arrived, the
prefill queued ahead of it then plus slack times that and its own prompt; each is reported once."""

from __future__ import annotations

import math

import pytest

from engine_adapter._fcfs_bound import FcfsBound


def test_a_turn_falls_due_after_the_work_ahead_plus_slack_times_its_fcfs_ttft() -> None:
    b = FcfsBound(0.5)
    b.computed(1000)  # earlier work does not count towards a later arrival
    b.arrived("a", 400, 200)  # due at 1000 + 400 + 0.5 * 600
    b.arrived("b", 0, 0)  # nothing ahead, nothing to compute: FCFS would start it now
    b.arrived("c", 0, 100)  # nothing ahead: a later turn may still overtake it by 50 tokens
    assert b.due(["a", "b", "c"]) == ["b"]
    assert b.due(["b"]) == []  # reported once
    b.computed(50)
    assert b.due(["a", "c"]) == ["c"]
    b.computed(649)
    assert b.due(["a"]) == []
    b.computed(1)
    assert b.due(["a"]) == ["a"] and b.num_due == 3 and len(b) == 0


def test_a_started_turn_is_forgotten_and_off_tracks_nothing() -> None:
    b = FcfsBound(0.0)
    b.arrived("a", 10, 5)
    b.forget("a")
    b.computed(100)
    assert b.due(["a"]) == [] and len(b) == 0
    off = FcfsBound(math.inf)
    off.arrived("a", 0, 0)
    assert not off.enabled and off.due(["a"]) == [] and len(off) == 0


@pytest.mark.parametrize("slack", [-0.1, math.nan])
def test_a_bad_slack_is_refused_naming_it(slack: float) -> None:
    with pytest.raises(ValueError, match="slack"):
        FcfsBound(slack)
