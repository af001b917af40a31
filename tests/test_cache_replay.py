"""Cache replay of Mooncake traces through the real block pool: hand-computed LRU / Belady / infinite hit
rates, the trace's last-block rule, error reporting, the real trace's Belady >= LRU, and the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine_adapter import replay_mooncake
from hintflow.cli import hintflow

BS = 512
CONVERSATION = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace_2000.jsonl"


def write_trace(tmp_path: Path, requests: list[tuple[list[int], int]], name: str = "trace.jsonl") -> Path:
    """Each request is (hash_ids, input_length)."""
    path = tmp_path / name
    lines = [
        json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
        for i, (ids, n) in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def full(*ids: int) -> tuple[list[int], int]:
    return list(ids), BS * len(ids)


def rates(result: dict, capacity_tokens: int) -> tuple[float, float]:
    (row,) = [r for r in result["capacities"] if r["capacity_tokens"] == capacity_tokens]
    return row["lru_hit_rate"], row["belady_hit_rate"]


def test_belady_beats_lru_by_hand(tmp_path: Path) -> None:
    # One-block requests A B C A B in a 2-block pool.
    #   LRU:    C evicts A, A evicts B, B evicts C              -> no hit.
    #   Belady: C evicts B (next use 4, A's is 3), A hits       -> 1 hit of 5 blocks.
    #   Infinite: A and B hit on their second use              -> 2 of 5.
    path = write_trace(tmp_path, [full(1), full(2), full(3), full(1), full(2)])
    result = replay_mooncake(path, [2 * BS, 2 * BS + 100])
    assert result["num_requests"] == 5
    assert result["input_tokens"] == 5 * BS
    assert result["infinite_hit_rate"] == pytest.approx(2 / 5)
    assert result["capacities"][0] == {
        "capacity_tokens": 2 * BS,
        "num_blocks": 2,
        "lru_hit_rate": 0.0,
        "belady_hit_rate": pytest.approx(1 / 5),
    }
    assert result["capacities"][1]["num_blocks"] == 2  # capacity rounds down to whole blocks
    assert rates(result, 2 * BS + 100) == (0.0, pytest.approx(1 / 5))


def test_three_blocks_hold_everything(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [full(1), full(2), full(3), full(1), full(2)])
    result = replay_mooncake(path, [3 * BS])
    assert rates(result, 3 * BS) == (pytest.approx(2 / 5), pytest.approx(2 / 5))


def test_release_keeps_the_chain_root_longest(tmp_path: Path) -> None:
    # [0,1] then [2] in a 2-block pool: blocks are released tail first, so [2] evicts block 1, not the root 0,
    # and the third request still hits its first block (512 of 2560 tokens) under both policies.
    path = write_trace(tmp_path, [full(0, 1), full(2), full(0, 1)])
    result = replay_mooncake(path, [2 * BS])
    assert rates(result, 2 * BS) == (pytest.approx(0.2), pytest.approx(0.2))


def test_request_larger_than_pool_inserts_what_fits(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [full(0, 1, 2, 3), full(0, 1, 2, 3)])
    result = replay_mooncake(path, [2 * BS])
    # Only blocks 0 and 1 were inserted: the second request hits 1024 of its 2048 tokens.
    assert rates(result, 2 * BS) == (pytest.approx(0.25), pytest.approx(0.25))
    assert result["infinite_hit_rate"] == pytest.approx(0.5)


def test_infinite_hit_rate_counts_longest_prefix_and_real_last_block(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        [
            ([0, 1], 700),  # 512 + 188 tokens
            ([0, 1, 2], 1200),  # block 1 is now a full 512-token block: a different block, only block 0 hits
            ([0, 1], 700),  # the 188-token block 1 is cached: all 700 hit
            ([0, 7, 8], 1536),  # shares only block 0
            ([0, 7, 9], 1536),  # shares blocks 0 and 7
        ],
    )
    result = replay_mooncake(path, [100 * BS])
    assert result["input_tokens"] == 700 + 1200 + 700 + 1536 + 1536
    hits = 0 + 512 + 700 + 512 + 1024
    assert result["infinite_hit_rate"] == pytest.approx(hits / result["input_tokens"])
    # A pool larger than the trace behaves like the infinite cache.
    assert rates(result, 100 * BS) == (pytest.approx(hits / result["input_tokens"]),) * 2
    assert result["clamped_requests"] == 0


def test_inconsistent_last_block_is_clamped(tmp_path: Path) -> None:
    # input_length past the ids: the extra tokens count as input but never hit; too short: the last block
    # counts one token.
    path = write_trace(tmp_path, [([0], 600), ([0], 600), ([1, 2], 100), ([1, 2], 100)])
    result = replay_mooncake(path, [10 * BS])
    assert result["clamped_requests"] == 4
    assert result["input_tokens"] == 600 + 600 + 513 + 513
    assert result["infinite_hit_rate"] == pytest.approx((512 + 513) / result["input_tokens"])


def test_limit_and_blank_lines(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [full(1), full(2), full(1)])
    path.write_text(path.read_text() + "\n\n")
    assert replay_mooncake(path, [BS], limit=2)["num_requests"] == 2
    assert replay_mooncake(path, [BS])["num_requests"] == 3
    assert replay_mooncake(path, [BS], limit=0)["input_tokens"] == 0


@pytest.mark.parametrize("bad", [0, -512])
def test_capacity_must_be_positive(tmp_path: Path, bad: int) -> None:
    path = write_trace(tmp_path, [full(1)])
    with pytest.raises(ValueError, match=str(bad)):
        replay_mooncake(path, [BS, bad])


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"input_length": 5}', "hash_ids"),
        ('{"hash_ids": [1]}', "input_length"),
        ('{"input_length": -1, "hash_ids": [1]}', "input_length"),
        ('{"input_length": 5, "hash_ids": [1, "x"]}', "hash_ids"),
    ],
)
def test_malformed_line_names_its_line(tmp_path: Path, line: str, what: str) -> None:
    path = write_trace(tmp_path, [full(1), full(2)])
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=rf"trace\.jsonl:3: .*{what}"):
        replay_mooncake(path, [BS])


def test_belady_never_below_lru_on_mooncake_conversation_trace() -> None:
    trace = CONVERSATION
    caps = [25_000, 100_000, 200_000, 400_000, 800_000, 1_600_000]
    result = replay_mooncake(trace, caps, limit=2000)
    assert result["num_requests"] == 2000
    for row in result["capacities"]:
        assert 0.0 <= row["lru_hit_rate"] <= row["belady_hit_rate"] <= result["infinite_hit_rate"] <= 1.0, row
    for a, b in itertools.pairwise(result["capacities"]):
        assert a["belady_hit_rate"] <= b["belady_hit_rate"]


def test_cli_json(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [full(1), full(2), full(3), full(1), full(2)])
    res = CliRunner().invoke(
        hintflow, ["engine", "cache-replay", str(path), "--capacity-tokens", "1024,2048", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert {"trace", "num_requests", "input_tokens", "infinite_hit_rate", "capacities"} <= out.keys()
    assert [r["capacity_tokens"] for r in out["capacities"]] == [1024, 2048]
    for row in out["capacities"]:
        assert {"capacity_tokens", "num_blocks", "lru_hit_rate", "belady_hit_rate"} <= row.keys()
    assert out["capacities"][0]["belady_hit_rate"] == pytest.approx(0.2)


def test_cli_table_and_default_capacities(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [full(1), full(1)])
    res = CliRunner().invoke(hintflow, ["engine", "cache-replay", str(path)])
    assert res.exit_code == 0, res.output
    assert "1,600,000" in res.stdout and "Belady" in res.stdout and "50.00%" in res.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--capacity-tokens", "100,abc"],
        ["--capacity-tokens", "100,0"],
        ["--capacity-tokens", ""],
    ],
)
def test_cli_bad_capacities_exit_2(tmp_path: Path, args: list[str]) -> None:
    path = write_trace(tmp_path, [full(1)])
    res = CliRunner().invoke(hintflow, ["engine", "cache-replay", str(path), *args])
    assert res.exit_code == 2
    assert "Traceback" not in res.output and "--capacity-tokens" in res.output


def test_cli_missing_and_malformed_trace_exit_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(hintflow, ["engine", "cache-replay", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "does not exist" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    res = CliRunner().invoke(hintflow, ["engine", "cache-replay", str(bad)])
    assert res.exit_code == 2 and "bad.jsonl:1:" in res.output and "Traceback" not in res.output


def test_cli_version() -> None:
    res = CliRunner().invoke(hintflow, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("hintflow ")
