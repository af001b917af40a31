"""Policy specs (``NAME:KEY=VALUE,...``) for workers and replay variants: parsed, checked, and applied."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest
from click.testing import CliRunner

from engine_adapter import SchedulerConfig
from orchestrator import POLICIES, POLICY_OPTIONS, PauseModel, PolicySpec, get_policy, parse_policy_spec
from orchestrator._policy_base import _BasePolicy
from replay import (
    SCHEDULER_OPTIONS,
    NodeSpec,
    ReplaySetup,
    Simulation,
    generate,
    get_replay_config,
    parse_policy_list,
    parse_variant,
    replay_command,
    report_json,
    run_replay,
)


def test_a_spec_builds_its_policy_with_its_options_winning_over_the_callers() -> None:
    p = get_policy("hintflow:rel_change=0.3,pause.min_samples=7,pause.default_mean_s=2", renew_ahead_s=0.25)
    assert p.rel_change == 0.3 and p.renew_ahead_s == 0.25
    assert p.pause_model.min_samples == 7 and p.pause_model.expected_remaining("any", 0.0) == pytest.approx(2.0)
    assert get_policy("continuum:renew_ahead_s=1.5", renew_ahead_s=0.25).renew_ahead_s == 1.5
    spec = parse_policy_spec(" kvflow:rel_change=0.2 , renew_ahead_s=none ", POLICIES)
    assert spec == PolicySpec("kvflow", (("rel_change", 0.2), ("renew_ahead_s", None)))
    assert str(spec) == "kvflow:rel_change=0.2,renew_ahead_s=none"
    assert parse_policy_spec(str(spec), POLICIES) == spec  # str() gives the spec back
    assert str(parse_policy_spec("hintflow", POLICIES)) == "hintflow"
    with pytest.raises(ValueError, match="pause_model object"):
        get_policy("hintflow:pause.capacity=10", pause_model=PauseModel())


@pytest.mark.parametrize(("text", "message"), [
    ("hintflw", "unknown policy 'hintflw'; known policies: continuum, hintflow, kvflow"),
    ("hintflow:rel_chang=1", "unknown option 'rel_chang'; known: rel_change, min_change_s, renew_ahead_s"),
    ("hintflow:rel_change=fast", "rel_change='fast': expected a finite number"),
    ("hintflow:rel_change=nan", "rel_change='nan': expected a finite number"),
    ("hintflow:rel_change=-0.1", "rel_change='-0.1': must be >= 0"),
    ("hintflow:pause.default_mean_s=0", "must be > 0"),
    ("hintflow:pause.min_samples=2.5", "pause.min_samples='2.5': expected an integer"),
    ("hintflow:rel_change", "'rel_change' is not KEY=VALUE"),
    ("hintflow:rel_change=1,rel_change=2", "option 'rel_change' given twice"),
])
def test_a_bad_spec_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        get_policy(text)


def test_documented_defaults_are_the_constructors() -> None:
    """Each option's help says its default: that must be what the policy really uses."""
    defaults = {name: p.default for name, p in inspect.signature(_BasePolicy.__init__).parameters.items()}
    defaults |= {f"pause.{n}": p.default for n, p in inspect.signature(PauseModel.__init__).parameters.items()}
    for key, option in POLICY_OPTIONS.items():
        assert key in defaults, key
        m = re.search(r"\(default ([0-9.]+)\)", option.doc)
        if m is not None:
            assert float(m.group(1)) == defaults[key], key


def test_scheduler_options_are_the_scheduler_config_fields() -> None:
    assert set(SCHEDULER_OPTIONS) == {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_variant_parsing_and_its_errors() -> None:
    v = parse_variant("eager=hintflow:policy.rel_change=0.02,scheduler.max_num_seqs=8,routing=session")
    assert (v.name, v.hint_policy, v.routing, v.host_tier) == ("eager", "hintflow", "session", True)
    assert v.policy_options == (("rel_change", 0.02),) and v.scheduler_options == (("max_num_seqs", 8),)
    w = parse_variant("eager2=eager:host_tier=off", [v])  # a variant of a variant keeps its options
    assert not w.host_tier and w.scheduler_options == v.scheduler_options
    assert [c.name for c in parse_policy_list("hintflow,eager2", [v, w])] == ["hintflow", "eager2"]
    assert parse_policy_list("all", [v])[-1] is v
    assert parse_variant("half=hintflow:pin_budget=0.7").pin_budget == 0.7
    for text, message in [
        ("eager", "expected NAME=BASE:KEY=VALUE"),
        ("hintflow=kvflow:routing=session", "the name 'hintflow' is already taken"),
        ("x=nope:routing=session", "unknown replay policy 'nope'; known: vllm-default"),
        ("x=hintflow:routing=fastest", "routing='fastest': expected one of hintflow, round-robin, session"),
        ("x=hintflow:scheduler.max_num_seqs=0", "scheduler.max_num_seqs='0': must be >= 1"),
        ("x=hintflow:policy.tick_s=1", "unknown option 'policy.tick_s'"),
        ("x=hintflow", "no options given"),
        ("x=hintflow:pin_budget=1", "pin_budget must be below 1"),
        ("x=hintflow:pin_budget=-0.1", "pin_budget='-0.1': must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_variant(text)


def test_a_variant_s_options_reach_its_policy_and_nodes() -> None:
    config = parse_variant("v=hintflow:policy.rel_change=0.5,policy.pause.min_samples=3,"
                           "scheduler.max_num_seqs=2,scheduler.ttft_deadline_s=none,pin_budget=0.75,"
                           "policy.memory_share=true")
    setup = ReplaySetup(block_size=16, ttft_deadline_s=4.0)
    programs = generate("swe-agent", seed=3, num_programs=2, rate=2.0, scale=0.05)
    spec = NodeSpec(4096, 4096, setup.cost(), ttft_deadline_s=4.0)
    sim = Simulation(programs, config, spec)
    assert sim.policy.rel_change == 0.5 and sim.policy.pause_model.min_samples == 3  # type: ignore[attr-defined]
    sched = sim.nodes[0].engine.scheduler.config
    assert sched.max_num_seqs == 2 and sched.ttft_deadline_s is None  # the variant's own setting wins
    assert sim.nodes[0].engine.kv.pin_budget_blocks == int(0.75 * 4096 / 16)
    assert sim.policy.ttl.memory_scale(16) == 4096 / 16  # type: ignore[attr-defined]  # the nodes' pool
    base_sim = Simulation(programs, get_replay_config("hintflow"), spec)
    base = base_sim.nodes[0].engine.scheduler.config
    assert base.max_num_seqs == 64 and base.ttft_deadline_s == 4.0
    assert base_sim.nodes[0].engine.kv.pin_budget_blocks == int(0.5 * 4096 / 16)
    assert base_sim.policy.ttl.memory_scale(16) == 1.0  # type: ignore[attr-defined]  # Continuum's cost


def _strip_wall(report: dict) -> dict:  # type: ignore[type-arg]
    for m in report["policies"].values():
        m.pop("wall_s")
    return report


def test_a_variant_at_the_defaults_replays_as_its_base_and_a_real_change_shows() -> None:
    programs = generate("swe-agent", seed=3, num_programs=6, rate=2.0, scale=0.05)
    same = parse_variant("same=hintflow:policy.rel_change=0.1,scheduler.admission_lookahead=64")
    one = parse_variant("one=hintflow:scheduler.max_num_seqs=1")
    setup, results = run_replay(ReplaySetup(block_size=16), [get_replay_config("hintflow"), same, one],
                                programs=programs)
    pol = _strip_wall(report_json(setup, results))["policies"]
    assert json.dumps(pol["same"], sort_keys=True) == json.dumps(pol["hintflow"], sort_keys=True)
    # One sequence a step queues turns (its JCT need not be longer: a lone decode is the cheapest step, and
    # a queued turn may move to the other node).
    assert pol["one"]["queue_wait_mean_s"] > 2 * pol["hintflow"]["queue_wait_mean_s"]


def test_cli_variants(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.json"
    res = CliRunner().invoke(replay_command, [
        "--programs", "3", "--scale", "0.05", "--rate", "2", "--block-size", "16", "--no-progress",
        "--variant", "lazy=hintflow:policy.rel_change=0.5", "-p", "hintflow,lazy", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"hintflow", "lazy"}
    assert report["config"]["policy_configs"]["lazy"]["policy_options"] == [["rel_change", 0.5]]
    res = CliRunner().invoke(replay_command, ["--variant", "x=hintflow:rel_change=1", "--no-progress"])
    assert res.exit_code == 2 and "unknown option 'rel_change'" in res.output and "policy.rel_change" in res.output
    res = CliRunner().invoke(replay_command, ["--backend", "vllm", "--variant", "x=hintflow:routing=session"])
    assert res.exit_code == 2 and "--variant" in res.output


@pytest.mark.parametrize(("policy", "routing"), [
    ("vllm-default", "session"), ("vllm-default:rel_change=0.2", "session"), ("hintflow", "hintflow"),
    ("continuum", "hintflow"),
])
def test_a_run_routes_as_its_policy_s_system_does(policy: str, routing: str) -> None:
    from hintflow import make_runtime

    runtime = make_runtime(["127.0.0.1:1"], policy, None)
    assert runtime.router.policy.name == routing
    assert make_runtime(["127.0.0.1:1"], policy, "h100-llama3-8b", "round-robin").router.policy.name == "round-robin"
