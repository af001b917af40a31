"""Decode windows (``replay/_fast_forward.py``) change how many events a replay takes, never what it reports:
every policy's metrics, every turn's times and node, and the memory samples are identical with and without
them, on workloads with tool pauses, joins, people's pauses, migrations, ThunderAgent's pauses and llm-d's
prefix reads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from replay import REPLAY_CONFIGS, ReplaySetup, Simulation, get_replay_config, metrics


def _replay(workload: str, policy: str, fast_forward: bool, **setup_kw: object):  # type: ignore[no-untyped-def]
    setup = ReplaySetup(workload=workload, seed=1, **setup_kw).with_defaults()  # type: ignore[arg-type]
    programs = setup.load_programs()
    cm = setup.cost()
    setup = setup.resolve(programs, cm)
    config = get_replay_config(policy)
    spec = dataclasses.replace(setup.node_spec(cm, infinite_kv=config.infinite_kv, programs=programs),
                               fast_forward=fast_forward)
    result = Simulation(programs, config, spec, num_nodes=setup.num_nodes, seed=setup.seed,
                        tick_s=setup.tick_s).run()
    m = metrics(result)
    for key in ("wall_s", "num_events"):  # how long it took, not what happened
        m.pop(key)
    turns = [(t.session_key, t.turn_index, t.node, t.ready_s, t.first_token_s, t.finished_s, t.hit_tokens)
             for t in result.turns]
    return m, turns, result.memory, result


CASES = [("swe-agent", p, {"num_programs": 30}) for p in REPLAY_CONFIGS] + [
    ("multi-agent", p, {"num_programs": 15}) for p in ("hintflow", "kvflow", "llm-d")
] + [("human-in-loop", p, {"num_programs": 5}) for p in ("hintflow", "vllm-default")]


@pytest.mark.parametrize(("workload", "policy", "kw"), CASES, ids=[f"{w}-{p}" for w, p, _ in CASES])
def test_decode_windows_leave_every_figure_unchanged(workload: str, policy: str, kw: dict) -> None:
    m0, turns0, mem0, r0 = _replay(workload, policy, False, **kw)
    m1, turns1, mem1, r1 = _replay(workload, policy, True, **kw)
    assert sum(n.num_bulk_steps for n in r1.nodes) > 0  # (windows ran)
    assert sum(n.num_bulk_steps for n in r0.nodes) == 0
    assert r1.num_events < r0.num_events
    assert json.dumps(m0, sort_keys=True) == json.dumps(m1, sort_keys=True)
    assert turns0 == turns1
    assert mem0 == mem1
    for a, b in zip(r0.nodes, r1.nodes, strict=True):  # engines end in the same state
        assert a.core.version == b.core.version
        assert a.core.kv.stats == b.core.kv.stats


def test_a_turn_arriving_exactly_when_a_bulk_step_starts_joins_that_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step by step, a step starting at time T is scheduled by an event queued behind whatever else happens
    at T, so a turn that arrives at exactly T is in it; a window must not have started it already (found by
    review: the arriving turn waited one step longer with windows)."""
    import replay._nodes as nodes_mod
    from replay import Program

    setup = ReplaySetup(workload="swe-agent", seed=1, num_programs=2, num_nodes=1).with_defaults()
    programs = setup.load_programs()
    cm = setup.cost()
    setup = setup.resolve(programs, cm)
    config = get_replay_config("vllm-default")

    def run(progs: list[Program], fast_forward: bool):  # type: ignore[no-untyped-def]
        spec = dataclasses.replace(setup.node_spec(cm, infinite_kv=False, programs=progs), fast_forward=fast_forward)
        return Simulation(progs, config, spec, num_nodes=1, seed=setup.seed, tick_s=setup.tick_s).run()

    first = dataclasses.replace(programs[0], arrival_s=0.0)
    ends: list[float] = []
    plan = nodes_mod.plan_window

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        win = plan(*a, **kw)
        if win is not None and not ends and len(win.ends) > 4:
            ends.extend(win.ends)
        return win

    monkeypatch.setattr(nodes_mod, "plan_window", spy)
    run([first], True)
    monkeypatch.setattr(nodes_mod, "plan_window", plan)
    assert ends
    both = [first, dataclasses.replace(programs[1], arrival_s=ends[2])]  # exactly when bulk step 3 starts
    waits = []
    for ff in (False, True):
        r = run(both, ff)
        waits.append(next(t.queue_wait_s for t in r.turns if t.program_id == both[1].program_id))
        m = metrics(r)
        for key in ("wall_s", "num_events"):
            m.pop(key)
        waits.append(json.dumps(m, sort_keys=True))
    assert waits[0] == 0.0 and waits[0] == waits[2] and waits[1] == waits[3]
