"""The program tracker and the hintflow policy's eviction order for sessions parked *between* turns."""

from __future__ import annotations

import math

import pytest

from hints import MAX_HORIZON_S, EvictionOrder
from orchestrator import (
    PauseModel,
    ProgramEnded,
    ProgramTracker,
    Tick,
    TurnEnded,
    TurnStarted,
    get_policy,
    role_of,
)


def test_role_of() -> None:
    assert role_of("p1", "p1/planner") == "planner"
    assert role_of("p1", "p1") == "agent"
    assert role_of("p1", "other/x") == "agent"


def _ping_pong(t: ProgramTracker, pid: str, t0: float, rounds: int = 3, step_s: float = 1.0) -> float:
    """Agents a and b take turns: llm:a, llm:b, llm:a, ... each lasting ``step_s``."""
    now = t0
    for _ in range(rounds):
        for role in ("a", "b"):
            t.turn_started(pid, f"{pid}/{role}", now, "PingPong")
            now += step_s
            t.turn_ended(pid, f"{pid}/{role}", now)
    return now


def test_session_waiting_for_the_other_agent_is_predicted_from_the_graph() -> None:
    t = ProgramTracker(PauseModel())
    _ping_pong(t, "p1", 0.0)
    t.program_ended("p1")
    # p2: a's turn ended, b's turn is running: a is next used when b's step ends, ~1 s.
    t.turn_started("p2", "p2/a", 100.0, "PingPong")
    t.turn_ended("p2", "p2/a", 101.0)
    t.turn_started("p2", "p2/b", 101.0, "PingPong")
    pred = t.predict("p2", ["p2/a"], 101.25)
    assert pred["p2/a"] == pytest.approx(0.75, abs=0.05)  # b's remaining time: 1 s mean, 0.25 s elapsed


def test_dead_session_goes_to_the_horizon_once_the_graph_is_trusted() -> None:
    t = ProgramTracker(PauseModel(), min_finished_for_dead=3)

    def pipeline(pid: str, now: float, stop_after_worker: bool = False) -> float:
        for role in ("planner", "worker", "reviewer"):
            t.turn_started(pid, f"{pid}/{role}", now, "Pipeline")
            now += 1.0
            t.turn_ended(pid, f"{pid}/{role}", now)
            if stop_after_worker and role == "worker":
                break
        return now

    for i in range(2):
        pipeline(f"p{i}", i * 10.0)
        t.program_ended(f"p{i}")
    now = pipeline("q", 50.0, stop_after_worker=True)
    assert "q/planner" not in t.predict("q", ["q/planner"], now)  # 2 finished runs: not trusted yet
    t.program_ended("q")
    now = pipeline("r", 80.0, stop_after_worker=True)
    assert t.predict("r", ["r/planner"], now) == {"r/planner": MAX_HORIZON_S}


def test_hintflow_policy_orders_between_turn_sessions_by_the_graph() -> None:
    policy = get_policy("hintflow", pause_model=PauseModel(), prefill_reload=lambda n: 0.0)
    now = 0.0
    for i in range(3):  # learn: planner -> worker -> reviewer
        pid = f"p{i}"
        for role in ("planner", "worker", "reviewer"):
            policy.on_event(TurnStarted(pid, f"{pid}/{role}", now, 100, "Pipeline"))
            now += 1.0
            policy.on_event(TurnEnded(pid, f"{pid}/{role}", now, 120))
        policy.on_event(ProgramEnded(pid, now, 3))
    pid = "live"
    policy.on_event(TurnStarted(pid, f"{pid}/planner", now, 100, "Pipeline"))
    policy.on_event(TurnEnded(pid, f"{pid}/planner", now + 1.0, 120))
    policy.on_event(TurnStarted(pid, f"{pid}/worker", now + 1.0, 100, "Pipeline"))
    hints = policy.on_event(Tick(now + 1.5))
    orders = [h for h in hints if isinstance(h, EvictionOrder)]
    entries = {e.session_id: e.next_use_s for o in orders for e in o.entries}
    assert entries[f"{pid}/planner"] == MAX_HORIZON_S  # its plan is out: first to go
    assert all(math.isfinite(v) for v in entries.values())
