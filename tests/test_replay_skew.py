"""The skewed multi-node workload (``-w skewed``, ``replay/_skewed.py``) and how the replay reports migrations:
the workload is a function of its seed, really skewed (one hot prefix for most programs, a few programs whose
contexts grow several times larger), and every policy's contexts moved between nodes are counted with bytes
and link time that agree with the tokens moved."""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay import (
    GENERATORS,
    Program,
    ReplaySetup,
    SkewedAgents,
    generate,
    parse_policy_list,
    render_table,
    replay_command,
    report_json,
    run_replay,
)

THREE = "llm-d,thunderagent,hintflow"
NO_MIGRATIONS = {
    "migrations": 0,
    "migrated_tokens": 0,
    "migrated_bytes": 0,
    "migration_transfer_s": 0.0,
    "failed_migrations": 0,
}


def _final_contexts(programs: list[Program], role: str) -> list[int]:
    return [p.max_context_tokens for p in programs if p.sessions[0].role == role]


def test_the_skewed_workload_is_a_function_of_its_seed() -> None:
    assert GENERATORS["skewed"] is SkewedAgents
    a = generate("skewed", seed=3, num_programs=60)
    assert a == generate("skewed", seed=3, num_programs=60)
    assert a != generate("skewed", seed=4, num_programs=60)
    assert generate("skewed", seed=3, num_programs=30) == a[:30]  # more programs keep the first ones
    assert [p.program_id for p in a] == [f"skewed-{i}" for i in range(60)]
    # a knob changes only what it names: the same programs are long, the same ones hot
    fewer_hot = generate("skewed", seed=3, num_programs=60, hot_fraction=0.5)
    assert [p.sessions[0].role for p in fewer_hot] == [p.sessions[0].role for p in a]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_hot_prefix_and_contexts_that_grow_unevenly(seed: int) -> None:
    programs = generate("skewed", seed=seed)  # the replay's defaults: 400 programs at 2/s
    assert len(programs) == 400
    prefixes = Counter(p.sessions[0].turns[0].shared_prefix for p in programs)
    (hot, num_hot), (_, num_next) = prefixes.most_common(2)
    assert hot == "skewed/hot" and 0.75 <= num_hot / len(programs) <= 0.85  # hot_fraction 0.8
    assert num_next < num_hot / 8  # every other prefix is one tenant's few programs
    long, short = _final_contexts(programs, "long-agent"), _final_contexts(programs, "agent")
    assert 0.06 <= len(long) / len(programs) <= 0.14  # long_fraction 0.1
    # the documented factor: long programs' final contexts about 5x the short ones' median, and no long
    # program ends below 2.5x the longest short one
    assert 4.5 <= statistics.fmean(long) / statistics.median(short) <= 6.0
    assert min(long) >= 2.5 * max(short)


def test_the_skewed_generator_refuses_shares_outside_zero_to_one() -> None:
    with pytest.raises(ValueError, match="hot_fraction must be in"):
        SkewedAgents(hot_fraction=1.5)
    with pytest.raises(ValueError, match="num_cold_prefixes must be >= 1"):
        SkewedAgents(num_cold_prefixes=0)


@pytest.fixture(scope="module")
def four_nodes():  # type: ignore[no-untyped-def]
    """A small four-node skewed replay of the three policies the issue compares (about 2 s)."""
    programs = generate("skewed", seed=0, num_programs=60, rate=3.0, scale=0.1)
    setup, results = run_replay(
        ReplaySetup(workload="skewed", num_nodes=4, block_size=32),
        parse_policy_list(THREE),
        programs=programs,
    )
    return programs, setup, results


def test_a_four_node_skewed_replay_finishes_every_program_under_each_policy(four_nodes) -> None:  # type: ignore[no-untyped-def]
    programs, _, results = four_nodes
    turns = sum(s.num_turns for p in programs for s in p.sessions)
    for r in results:
        assert sorted(p.program.program_id for p in r.programs if p.end_s is not None) == sorted(
            p.program_id for p in programs
        ), r.config.name
        assert len(r.turns) == turns, r.config.name
        assert {t.node for t in r.turns} == {f"node-{i}" for i in range(4)}, r.config.name


def test_migrations_are_reported_with_bytes_and_link_time_that_agree(four_nodes) -> None:  # type: ignore[no-untyped-def]
    _, setup, results = four_nodes
    report = report_json(setup, results)
    pols = report["policies"]
    hf = pols["hintflow"]
    bytes_per_token = report["config"]["cost_model_coefficients"]["kv_bytes_per_token"]
    assert bytes_per_token == 131072  # (h100-llama3-8b: 32 layers x 8 KV heads x 128 x K,V x 2 bytes)
    assert hf["migrations"] > 0 and hf["failed_migrations"] == 0
    assert hf["migrated_bytes"] == hf["migrated_tokens"] * bytes_per_token
    assert hf["migration_transfer_s"] == pytest.approx(
        hf["migrated_tokens"] * report["config"]["link_s_per_token"]
    )
    # a turn moved twice records its last copy only
    assert 0 < sum(t.migrated_tokens for t in results[-1].turns) <= hf["migrated_tokens"]
    for name in ("llm-d", "thunderagent"):  # neither moves a context: a session they move is recomputed
        assert {k: pols[name][k] for k in NO_MIGRATIONS} == NO_MIGRATIONS
    assert all(m["throughput_programs_per_s"] > 0 for m in pols.values())
    table = render_table(report)
    moved = next(
        line for line in table.splitlines() if line.startswith("| hintflow | ") and line.count("|") == 7
    )
    assert moved.split("|")[2].strip() == f"{hf['migrations']:,}"
    assert f"{hf['migrated_bytes'] / 1e9:.2f}" in moved
    assert "llm-d, thunderagent: move no contexts" in table


def test_the_command_writes_migrations_to_json_and_csv(tmp_path: Path) -> None:
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    args = f"-w skewed --nodes 4 --programs 40 --rate 4 --scale 0.1 --block-size 32 -p {THREE} -j 1 --no-progress"
    res = CliRunner().invoke(replay_command, [*args.split(), "--json", str(out_json), "--csv", str(out_csv)])
    assert res.exit_code == 0, res.output
    assert "failed imports" in res.output and "skewed: 40 programs, 4 node(s)" in res.output
    pols = json.loads(out_json.read_text())["policies"]
    with out_csv.open() as f:
        rows = {row["policy"]: row for row in csv.DictReader(f)}
    assert list(rows) == THREE.split(",")
    for name, row in rows.items():
        for key in ("migrations", "migrated_tokens", "migrated_bytes", "failed_migrations"):
            assert int(row[key]) == pols[name][key]
        assert float(row["jct_mean_s"]) == pytest.approx(pols[name]["jct_mean_s"])
    assert rows["thunderagent"]["thunderagent_pauses"] != "" and rows["llm-d"]["thunderagent_pauses"] == ""
