"""``hintflow replay --executor torch``: real compute on every node, measured step times, same harness.

What could go wrong and is checked here: a program that never finishes (the torch executor rejects a
batch the modeled one accepts: vocab, max_model_len, block size), steps that are priced rather than
computed, KV that host offload/reload or recomputation corrupts (the greedy token after each prompt must
equal a plain full forward's), policies that stop differing on real nodes, and a report that still says
"modeled".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine_adapter import TorchExecutor
from replay import Program, Simulation, generate, get_replay_config, replay_command, report_json
from replay._setup import ReplaySetup, longest_request_tokens, run_replay

POLICIES = ("vllm-default", "hintflow")


def _programs() -> list[Program]:
    # contexts up to ~1.6k tokens; one node with a 2,000-token device pool: both policies lose contexts
    # (vllm-default recomputes, hintflow reloads from host), which the KV checks below need
    return generate("swe-agent", seed=3, num_programs=6, rate=2.0, scale=0.05)


@pytest.fixture(scope="module")
def torch_run() -> dict[str, Any]:
    """One torch replay of both policies; every finished request's prompt and first output token kept."""
    finished: list[tuple[str, str, list[int], int, int, int]] = []
    original = Simulation._turn_finished

    def spy(self: Simulation, node: Any, req: Any) -> None:
        finished.append(
            (
                self.config.name,
                node.address,
                list(req.prompt),
                req.output[0],
                req.num_host_hit_tokens,
                req.num_recomputed_tokens,
            )
        )
        original(self, node, req)

    programs = _programs()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulation, "_turn_finished", spy)
        setup, results = run_replay(
            ReplaySetup(executor="torch", num_nodes=1, kv_capacity_tokens=2000),
            [get_replay_config(p) for p in POLICIES],
            programs=programs,
        )
    # before any reference forward adds to the executors' counters
    embedded = {r.config.name: sum(_torch(n).tokens_embedded for n in r.nodes) for r in results}
    return {
        "programs": programs,
        "setup": setup,
        "results": results,
        "finished": finished,
        "embedded": embedded,
        "report": report_json(setup, results),
    }


def _torch(node: Any) -> TorchExecutor:
    ex = node.engine.executor
    assert isinstance(ex, TorchExecutor), type(ex)
    return ex


def test_every_program_and_turn_finishes(torch_run: dict[str, Any]) -> None:
    expected = {p.program_id: p.num_turns for p in torch_run["programs"]}
    for r in torch_run["results"]:
        got: dict[str, int] = {}
        for t in r.turns:
            got[t.program_id] = got.get(t.program_id, 0) + 1
        assert got == expected, r.config.name
        assert all(run.end_s is not None and run.end_s >= run.arrival_s for run in r.programs)
        for node in r.nodes:
            node.engine.check_invariants()
            kv = node.engine.kv
            assert kv.device.num_free_blocks == kv.device.num_blocks, (r.config.name, node.address)
            assert kv.host.num_free_blocks == kv.host.num_blocks
            assert not node.engine.scheduler.has_work()


def test_steps_are_computed_and_timed(torch_run: dict[str, Any]) -> None:
    report = torch_run["report"]
    for r in torch_run["results"]:
        m = report["policies"][r.config.name]
        # every token a step scheduled went through the real model, and nothing else did
        assert torch_run["embedded"][r.config.name] == m["step_tokens"] > 0
        assert m["step_tokens"] >= m["computed_prompt_tokens"] > 0
        assert sum(n.num_steps for n in r.nodes) == m["num_steps"] > 0
        for node in r.nodes:
            assert node.measured and _torch(node).config.block_size == node.block_size == 16
            if node.num_steps:  # the router may leave a node idle on so small a run
                assert node.step_s > 0
                assert node.step_s != node.modeled_step_s  # measured, not the cost model's price


def test_greedy_tokens_match_a_plain_forward(torch_run: dict[str, Any]) -> None:
    """The token sampled after each prompt is a full forward's argmax, also after host reloads and
    recomputation: the paged KV the replay's scheduling produced is the right KV."""
    nodes = {(r.config.name, n.address): n for r in torch_run["results"] for n in r.nodes}
    picked: dict[str, list[tuple[str, list[int], int]]] = {p: [] for p in POLICIES}
    for policy, address, prompt, token, host_hits, recomputed in torch_run["finished"]:
        if host_hits or recomputed:
            picked[policy].append((address, prompt, token))
    assert picked["hintflow"], "no hintflow turn reloaded from host: no memory pressure"
    assert picked["vllm-default"], "no vllm-default turn recomputed: no memory pressure"
    for policy, turns in picked.items():
        for address, prompt, token in turns[:6]:
            ref = _torch(nodes[(policy, address)]).reference_logits(prompt)
            assert int(ref.argmax()) == token, (policy, address, len(prompt))


def test_hints_save_recomputation_on_real_nodes(torch_run: dict[str, Any]) -> None:
    pols = torch_run["report"]["policies"]
    assert pols["vllm-default"]["recomputed_tokens"] > 0
    assert pols["hintflow"]["recomputed_tokens"] < pols["vllm-default"]["recomputed_tokens"]
    assert pols["hintflow"]["reloaded_blocks"] > 0  # real d2h/h2d copies ran
    assert pols["hintflow"]["across_turn_hit_rate"] > pols["vllm-default"]["across_turn_hit_rate"]


def test_report_says_torch_and_measured(torch_run: dict[str, Any]) -> None:
    config = torch_run["report"]["config"]
    assert config["executor"] == "torch"
    assert config["cost_model"] == "cpu-tiny" and config["block_size"] == 16
    assert "measured" in config["step_time"]
    assert config["num_programs"] == len(torch_run["programs"])


def test_torch_defaults_and_model_length() -> None:
    torch_setup = ReplaySetup(executor="torch").with_defaults()
    assert (torch_setup.cost_model, torch_setup.block_size) == ("cpu-tiny", 16)
    assert (torch_setup.num_programs, torch_setup.scale, torch_setup.rate) == (40, 0.05, 0.5)
    modeled = ReplaySetup().with_defaults()
    assert (modeled.cost_model, modeled.block_size) == ("h100-llama3-8b", 128)
    assert (modeled.num_programs, modeled.scale) == (100, 0.25)
    given = ReplaySetup(
        executor="torch", cost_model="h100-llama3-8b", block_size=32, scale=0.1
    ).with_defaults()
    assert (given.cost_model, given.block_size, given.scale) == ("h100-llama3-8b", 32, 0.1)
    programs = _programs()
    cm = torch_setup.cost()
    spec = torch_setup.resolve(programs, cm).node_spec(cm, infinite_kv=False, programs=programs)
    assert spec.executor == "torch"
    assert longest_request_tokens(programs) < spec.max_model_len <= longest_request_tokens(programs) + 32
    with pytest.raises(ValueError, match="executor"):
        ReplaySetup(executor="gpu")


def test_cli_torch_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        replay_command,
        [
            "--executor",
            "torch",
            "--programs",
            "3",
            "--scale",
            "0.02",
            "--rate",
            "2",
            "--policy",
            "vllm-default",
            "--json",
            str(out),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "torch nodes, measured step times" in res.output and "cpu-tiny" in res.output
    report = json.loads(out.read_text())
    assert report["config"]["executor"] == "torch"
    assert report["policies"]["vllm-default"]["num_programs"] == 3
