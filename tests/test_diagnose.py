"""``hintflow diagnose``: the six questions on recorded runs of the example coding agent (hosted form,
driven through ``record_client`` against the stand-in providers of ``tests/hosted_support.py``), on replay
traces, on synthetic runs with nodes and latencies, and the HTML report opened in a headless browser.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from diagnose import Run, Segment, TurnRecord, diagnose_run, load_run, render_html, segment_hash, write_html
from hintflow.cli import hintflow
from replay import dump_jsonl, generate
from tests.hosted_support import record_coding_agents


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two recordings: a clean run, and one whose harness reorders its tools at turn 5 (with a clean one)."""
    d = tmp_path_factory.mktemp("runs")
    clean, broken = d / "clean.jsonl", d / "reorder.jsonl"
    record_coding_agents(clean, runs={"clean-a": {}, "clean-b": {}})
    record_coding_agents(broken, runs={"clean": {}, "reorder": {"reorder_tools_at": 5}})
    return {"clean": clean, "reorder": broken}


def test_a_run_that_reorders_its_tools_at_turn_5_is_named_with_that_turn_and_block(recorded: dict[str, Path]) -> None:
    diag = diagnose_run(load_run(recorded["reorder"]))
    early = diag.finding("early_blocks")
    assert early.status == "bad"
    assert early.rows == [{"program_id": "reorder", "session_id": "reorder/agent", "turn": 5, "block": "tools",
                           "change": "reordered", "lost_tokens": early.rows[0]["lost_tokens"]}]
    assert early.rows[0]["lost_tokens"] > 1000  # tools + system + history: all sent again
    assert "tool definitions reordered at turn 5 of session reorder/agent" in early.verdict
    # the provider's report shows the same turn cold, and the application is blamed for it
    turn5 = next(f for f in diag.facts if f.rec.program_id == "reorder" and f.rec.turn == 5)
    assert turn5.rec.cached_tokens == 0 and turn5.brk is not None
    forced = diag.finding("forced_cold")
    assert forced.numbers["app_forced_turns"] == 1 and forced.status == "bad"


def test_a_clean_run_reports_a_stable_prefix(recorded: dict[str, Path]) -> None:
    diag = diagnose_run(load_run(recorded["clean"]))
    assert diag.num_programs == 2 and diag.num_turns == 20
    early = diag.finding("early_blocks")
    assert early.status == "ok" and early.verdict.startswith("stable prefix")
    reuse = diag.finding("prefix_reuse")
    assert reuse.numbers["repeated_fraction"] > 0.8
    reported = diag.finding("reported_cache")
    assert reported.numbers["ratio"] > 0.9  # the stand-in cached what repeated (in 128-token steps)
    assert diag.finding("forced_cold").status == "ok"
    assert diag.finding("hotspot").status == "n/a"  # a hosted API names no node


def test_diagnose_command_prints_the_verdicts_and_writes_json_and_html(recorded: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    out_json, out_html = tmp_path / "d.json", tmp_path / "d.html"
    result = CliRunner().invoke(hintflow, ["diagnose", str(recorded["reorder"]), "--json", str(out_json),
                                           "--html", str(out_html)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "tool definitions reordered at turn 5" in result.output
    data = json.loads(out_json.read_text())
    assert set(data["findings"]) == {"prefix_reuse", "reported_cache", "early_blocks", "slow_turns", "hotspot",
                                     "forced_cold"}
    assert data["findings"]["early_blocks"]["rows"][0]["turn"] == 5
    assert out_html.stat().st_size > 10_000


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_the_html_report_opens_in_a_headless_browser_with_its_plots(recorded: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    html_path = write_html(diagnose_run(load_run(recorded["reorder"])), tmp_path / "report.html")
    text = html_path.read_text()
    # self-contained: no scripts, no external links or images; one inline SVG per plot with data
    assert "<script" not in text and not re.search(r'(src|href)="(https?:)?//', text)
    assert text.count("<svg") == 3  # reuse per turn, pauses per tool, TTFT (two panels in one figure)
    assert "no node recorded" in text  # the per-node plot says why it is empty
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: scripts/install.sh dev installs it with apt-get where it can")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", f"--screenshot={shot}",
                    "--window-size=1200,2600", html_path.as_uri()],
                   capture_output=True, timeout=180, check=False)
    assert shot.is_file() and shot.stat().st_size > 20_000, "chromium wrote no screenshot"
    import matplotlib.image as mpimg

    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.std() > 0.05  # not a blank page
    blue = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.08, axis=2)  # matplotlib's C0
    red = np.all(np.abs(pixels - np.array([0xD6, 0x27, 0x28]) / 255) < 0.08, axis=2)  # C3: the broken turn
    assert blue.sum() > 500, f"the plot lines are missing from the screenshot ({blue.sum()} C0 pixels)"
    assert red.sum() > 50
    rows = np.nonzero(blue.any(axis=1))[0]  # the blue lines and points sit in three separate plots
    assert np.count_nonzero(np.diff(rows) > 60) >= 2, rows


def _turn(program: str, i: int, *, node: str = "", latency_s: float = 0.5, cached: int | None = None,
          start_s: float = 0.0, pause_s: float | None = 1.0, tools: str = "t1") -> TurnRecord:
    segs = (Segment("tools", segment_hash(tools), 500), Segment("system", segment_hash("s"), 500),
            *(Segment("message", segment_hash(f"{program}/{k}"), 200) for k in range(i + 1)))
    return TurnRecord(program, program, i, start_unix_s=start_s, latency_s=latency_s, provider="hintflow",
                      segments=segs, input_tokens=sum(s.num_tokens for s in segs), cached_tokens=cached,
                      node=node, tool="bash" if pause_s is not None else None, pause_s=pause_s)


def test_slow_turns_are_matched_to_cold_starts_and_a_hot_node_is_named() -> None:
    turns = []
    for p in range(12):  # 12 programs of 6 turns; node-a takes 10 of them, node-b 2
        node = "node-a" if p < 10 else "node-b"
        for i in range(6):
            cold = i == 3 and p % 2 == 0  # some turns lose their cache
            could = 1000 + 200 * i
            turns.append(_turn(f"p{p}", i, node=node, start_s=100.0 * p + 10 * i,
                               latency_s=3.0 if cold else 0.3, cached=0 if cold else could))
    diag = diagnose_run(Run("recorded", "synthetic", turns))
    slow = diag.finding("slow_turns")
    assert slow.status == "warn" and "cold start" in slow.verdict, slow.verdict
    hot = diag.finding("hotspot")
    assert hot.status == "bad" and hot.numbers["hottest"] == "node-a" and hot.numbers["idlest"] == "node-b"
    served = diag.finding("forced_cold")
    assert served.numbers["serving_lost_turns"] == 6 and served.numbers["app_forced_turns"] == 0
    assert render_html(diag).count("<svg") == 4  # with nodes, the per-node plot is drawn too


def test_a_replay_trace_and_a_generator_are_diagnosed_with_what_they_carry(tmp_path: Path) -> None:
    path = tmp_path / "swe.jsonl"
    dump_jsonl(generate("swe-agent", seed=1, num_programs=5), path)
    diag = diagnose_run(load_run(path))
    assert diag.source == "replay" and diag.num_programs == 5
    assert diag.finding("early_blocks").status == "ok"  # a replay trace extends its context by construction
    assert diag.finding("prefix_reuse").numbers["repeated_fraction"] > 0.5
    for key in ("reported_cache", "slow_turns", "hotspot"):
        assert diag.finding(key).status == "n/a", key
    gen = diagnose_run(load_run("human-in-loop:num_turns=3-4"))
    assert gen.source == "generator" and gen.num_turns > 0
    # the first turns of different programs share the generator's system prompt: "could have been cached"
    firsts = [f for f in gen.facts if f.index == 0]
    assert sum(f.could_cache_tokens > 0 for f in firsts) == len(firsts) - 1


def test_every_replay_generator_can_be_diagnosed_by_name() -> None:
    import replay
    from diagnose._readers import _GENERATOR_NAMES

    assert set(_GENERATOR_NAMES) == set(replay.GENERATORS)
