"""scripts/mirror_turns.py: a real run joined turn by turn with the replay's mirror (``vllm_predict.py --turns``).

A real report needs a vLLM server (minutes); here the "real" side is a replay's own turns written in the
report's shape, so a join that pairs the wrong turns, or a figure read from the wrong side, shows up as a
disagreement between a run and itself."""

from __future__ import annotations

import math
from typing import Any

import pytest

from replay import ReplaySetup, get_replay_config, run_replay
from tests.scripts_support import load_script


@pytest.fixture(scope="module")
def replayed() -> list[Any]:
    setup = ReplaySetup(workload="swe-agent", seed=1, num_programs=6, num_nodes=1, host_capacity_tokens=4096)
    _, results = run_replay(setup, [get_replay_config("hintflow")])
    return list(results[0].turns)


def _as_report(turns: list[Any]) -> list[dict[str, Any]]:
    """Turn records in the shape of a vLLM report's ``programs[MODE]``."""
    by_program: dict[str, list[Any]] = {}
    for t in sorted(turns, key=lambda t: (t.program_id, t.turn_index)):
        by_program.setdefault(t.program_id, []).append(t)
    return [{"program": pid, "turns": [
        {"sent_s": t.ready_s, "ttft_s": t.ttft_s, "latency_s": t.finished_s - t.ready_s,
         "cached_tokens": t.device_hit_tokens + t.host_hit_tokens, "already_sent_tokens": t.history_tokens}
        for t in ts]} for pid, ts in by_program.items()]  # fmt: skip


def test_a_run_beside_itself_agrees_turn_by_turn(replayed: list[Any]) -> None:
    mt = load_script("mirror_turns")
    pairs = mt.pair_turns(_as_report(replayed), replayed)
    assert len(pairs) == len(replayed) > 12
    returning = [p for p in pairs if not p.first]
    assert returning and any(p.real_found_tokens for p in returning)  # the run kept something to compare
    for p in pairs:
        assert p.real_ttft_s == p.mirror_ttft_s
        assert p.real_found_tokens == p.mirror_found_tokens <= p.history_tokens
        assert p.first == math.isnan(p.pause_s)
    assert all(p.pause_s >= 0 for p in returning)  # a turn is sent after the one before it finished
    # shuffled within each program, the pairs disagree: the join is by (program, turn index), not by order
    shifted = [dict(prog, turns=prog["turns"][1:] + prog["turns"][:1]) for prog in _as_report(replayed)]
    assert any(p.real_ttft_s != p.mirror_ttft_s for p in mt.pair_turns(shifted, replayed))


def test_a_turn_only_one_side_served_is_left_out(replayed: list[Any]) -> None:
    mt = load_script("mirror_turns")
    report = _as_report(replayed)
    dropped = (report[0]["program"], 1)
    mirror = [t for t in replayed if (t.program_id, t.turn_index) != dropped]
    pairs = mt.pair_turns(report, mirror)
    assert len(pairs) == len(replayed) - 1
    assert dropped not in {(p.program, p.index) for p in pairs}


def test_bins_count_returning_turns_and_the_tail_tells_first_from_returning() -> None:
    mt = load_script("mirror_turns")
    P = mt.TurnPair
    pairs = [
        P("a", 0, 0.5, math.nan, 0, 0, 0, 0, 4.0, 1.0),
        P("a", 1, 3.0, 0.4, 1000, 1000, 500, 1000, 0.2, 0.3),
        P("a", 2, 12.0, 2.5, 2000, 0, 2000, 2000, 3.0, 0.1),
        P("b", 0, 11.0, math.nan, 0, 0, 0, 0, 1.0, 2.0),
        P("b", 1, 14.0, 9.0, 1000, 500, 0, 1000, 1.0, 1.0),
    ]
    by_time = mt.bin_table(pairs, lambda p: p.sent_s, 10.0, title="sent at (s)")
    assert by_time[2].startswith("| 0–10 | 1 | 100% / 50% |")
    assert by_time[3].startswith("| 10–20 | 2 | 17% / 67% |")  # (0 + 500) / 3000, (2000 + 0) / 3000
    by_pause = mt.bin_table(pairs, lambda p: p.pause_s, 1.0, cap=8.0, title="pause (s)")
    assert [r.split(" | ")[0] for r in by_pause[2:]] == ["| 0–1", "| 2–3", "| 8+"]
    tail = mt.tail_table(pairs)
    assert tail[2].startswith("| first | 2 | 2.50 / 1.50 s |")  # medians of (4, 1) and (1, 2)
    assert tail[3].startswith("| returning | 3 | 1.00 / 0.30 s |")
    assert mt.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and math.isnan(mt.quantile([], 0.5))
    text = mt.format_turns(pairs, num_slowest=1)
    assert "a t0, 0.5 s, first, -, 4.00 / 1.00 s" in text  # the real side's slowest
    assert "a t2, 12.0 s, 2.50 s, 0% / 100%, 3.00 / 0.10 s" not in text.split("mirror:")[-1]
    assert "b t0, 11.0 s, first, -, 1.00 / 2.00 s" in text.split("mirror:")[-1]  # the mirror's slowest
