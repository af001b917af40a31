"""``hintflow replay --backend vllm``: replay's workloads against real vLLM servers.

Fast (no vLLM): a replay program becomes the benchmark's token-id program with its token counts, outputs
(capped), tools and pauses, shared prefixes shared, sessions with their ``after`` / ``join``; the client
runs a program's sessions in dependency order (AND and OR joins) against a fake OpenAI server; options that
do not fit the backend are usage errors.

Real (skipped, saying why, only where no Python with vLLM exists: ``find_vllm_python`` as in
tests/test_vllm_backend.py): three one-session programs of three turns from a trace file, ``vanilla`` and
``hintflow-infer+host`` (two server starts: stock vLLM, and hintflow's scheduler with its host tier), a
40-block pool; every program finishes in both, the table and the JSON name both modes, and the later turns
hit the cache under hintflow.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from replay import Program, Session, Turn, dump_jsonl, generate, read_workload, replay_command
from replay._vllm_agents import run_program
from replay._vllm_workload import (
    MAX_OUTPUT,
    AgentProgram,
    AgentSession,
    AgentTurn,
    agent_programs,
    export_trace,
    pool_blocks_for,
)


def _trace_programs() -> list[Program]:
    """Three one-session programs of three turns, sharing a 200-token system prompt."""
    out = []
    for i in range(3):
        turns = [
            Turn(400 + 10 * i, 8, "bash", 0.4, shared_prefix="sys", shared_prefix_tokens=200),
            Turn(150, 40, "python", 0.2),  # output above the cap
            Turn(120, 6),
        ]
        out.append(Program(f"p{i}", 0.3 * i, "test", [Session("agent", "agent", turns)]))
    return out


# ---- conversion ----------------------------------------------------------------------------------------
def test_conversion_keeps_counts_pauses_and_shared_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    dump_jsonl(_trace_programs(), path)
    programs = read_workload(f"hintflow:{path}", seed=0)
    agents = agent_programs(programs, seed=0)
    assert [a.program_id for a in agents] == ["p0", "p1", "p2"]
    for p, a in zip(programs, agents, strict=True):
        assert a.arrival_s == p.arrival_s and not a.sessions and len(a.all_sessions) == 1
        assert a.all_sessions[0].session_id == p.program_id  # the benchmark's shape: the session is the program
        for t, at in zip(p.sessions[0].turns, a.turns, strict=True):
            assert len(at.new_tokens) == t.input_tokens
            assert at.output_tokens == min(MAX_OUTPUT, t.output_tokens)
            assert (at.tool, at.pause_s) == (t.tool, t.tool_duration_s)
    first = [a.turns[0].new_tokens for a in agents]
    assert first[0][:200] == first[1][:200] == first[2][:200]  # the shared system prompt
    assert first[0][200:210] != first[1][200:210]  # the rest is each program's own
    # deterministic per seed and program, whatever else is replayed
    assert agent_programs(programs[1:], seed=0)[0] == agents[1]
    assert agent_programs(programs, seed=1)[0].turns[0].new_tokens != first[0]
    # the trace the benchmark exports reads back with the same counts
    back = tmp_path / "back.jsonl"
    back.write_text(export_trace(agents))
    again = read_workload(f"hintflow:{back}", seed=0)
    assert [t.input_tokens for t in again[2].sessions[0].turns] == [len(t.new_tokens) for t in agents[2].turns]


def test_conversion_keeps_sessions_and_joins() -> None:
    programs = generate("multi-agent", seed=3, num_programs=6, scale=0.1, or_join_fraction=0.5)
    agents = agent_programs(programs, seed=0)
    joins = set()
    for p, a in zip(programs, agents, strict=True):
        assert [s.session_id for s in a.sessions] == [s.session_id for s in p.sessions]
        for s, agent_s in zip(p.sessions, a.sessions, strict=True):
            assert (agent_s.after, agent_s.join) == (tuple(s.after), s.join)
            assert [len(t.new_tokens) for t in agent_s.turns] == [t.input_tokens for t in s.turns]
            assert [t.pause_s for t in agent_s.turns] == [t.tool_duration_s for t in s.turns]
            joins.add(s.join)
        assert a.num_turns == p.num_turns
    assert joins == {"and", "or"}
    blocks, live = pool_blocks_for(agents, fraction=1 / 3)
    assert blocks >= 1 and live > 0


def test_critical_path_follows_and_or_joins() -> None:
    def session(sid: str, pause: float, after: tuple[str, ...] = (), join: str = "and") -> AgentSession:
        return AgentSession(sid, (AgentTurn((1, 2), 1, "t", pause), AgentTurn((3,), 1, None, 0.0)), after, join)

    def program(join: str) -> AgentProgram:
        return AgentProgram("x", 0.0, sessions=(session("a", 1.0), session("b", 5.0), session("c", 0.0, ("a", "b"), join)))

    assert program("and").unloaded_s(0.0) == 5.0
    assert program("or").unloaded_s(0.0) == 5.0  # b still runs past c's end: the program ends with it
    assert program("or").unloaded_s(1.0) == 7.0  # b: 5 + 2 turns; c after a: 1 + 2 + 2
    with pytest.raises(ValueError, match="exactly one"):
        AgentProgram("y", 0.0)
    with pytest.raises(ValueError, match="bad after"):
        AgentProgram("z", 0.0, sessions=(session("a", 0.0, ("nope",)),))


# ---- the client against a fake OpenAI server -----------------------------------------------------------
class _FakeVllm:
    """Answers /v1/completions as a streamed completion with a final usage chunk; records every request."""

    def __init__(self, fail_session: str = "", delay_s: float = 0.02) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                t_in = time.monotonic()
                time.sleep(delay_s)
                if body["session_id"] == fail_session:
                    self.send_response(500)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = len(body["prompt"])
                chunks = [{"choices": [{"text": "x"}]},
                          {"choices": [], "usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}}]
                for c in chunks:
                    self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                with fake.lock:
                    fake.requests.append({**body, "t_in": t_in, "t_out": time.monotonic()})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, session_id: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["session_id"] == session_id]


@pytest.fixture
def fake_vllm() -> Iterator[_FakeVllm]:
    fake = _FakeVllm()
    yield fake
    fake.server.shutdown()


def _pipeline(join: str) -> AgentProgram:
    """planner -> fast and slow workers -> reviewer (AND or OR join)."""
    def turns(*pauses: float) -> tuple[AgentTurn, ...]:
        return tuple(AgentTurn((7,) * 20, 2, "t" if p else None, p) for p in pauses)

    return AgentProgram("P", 0.0, sessions=(
        AgentSession("planner", turns(0.0)),
        AgentSession("fast", turns(0.05, 0.0), ("planner",)),
        AgentSession("slow", turns(0.6, 0.0), ("planner",)),
        AgentSession("reviewer", turns(0.0), ("fast", "slow"), join),
    ))  # fmt: skip


@pytest.mark.parametrize("join", ["and", "or"])
def test_sessions_start_when_their_join_is_met(fake_vllm: _FakeVllm, join: str) -> None:
    res = run_program(fake_vllm.base, "m", _pipeline(join), time.monotonic(), "infer")
    assert res.error == "" and len(res.turns) == 6
    assert {t.session_id for t in res.turns} == {"P/planner", "P/fast", "P/slow", "P/reviewer"}
    first = {s: min(r["t_in"] for r in fake_vllm.of(f"P/{s}")) for s in ("planner", "fast", "slow", "reviewer")}
    last_out = {s: max(r["t_out"] for r in fake_vllm.of(f"P/{s}")) for s in ("planner", "fast", "slow", "reviewer")}
    assert first["fast"] >= last_out["planner"] and first["slow"] >= last_out["planner"]
    assert abs(first["fast"] - first["slow"]) < 0.3  # the workers run side by side
    if join == "and":
        assert first["reviewer"] >= last_out["slow"]
    else:
        assert last_out["fast"] <= first["reviewer"] < last_out["slow"]
    assert all(r["vllm_xargs"]["program_id"] == "P" for r in fake_vllm.requests)
    flagged = [r["session_id"] for r in fake_vllm.requests if r["vllm_xargs"]["is_last_turn"]]
    # the program's last turn is flagged only when no other session is left (AND: the reviewer's)
    assert flagged == (["P/reviewer"] if join == "and" else ["P/slow"])
    assert res.jct_s >= 0.6


def test_failed_session_ends_the_program() -> None:
    fake = _FakeVllm(fail_session="P/fast")
    try:
        res = run_program(fake.base, "m", _pipeline("and"), time.monotonic(), "plain")
    finally:
        fake.server.shutdown()
    assert res.error.startswith("session fast: HTTPError")
    assert fake.of("P/reviewer") == []  # its join can no longer be met: never started
    assert len(fake.of("P/slow")) == 2  # a running session finishes its turns


def test_one_session_program_is_sent_as_before(fake_vllm: _FakeVllm) -> None:
    prog = AgentProgram("solo", 0.0, (AgentTurn((5,) * 10, 3, "bash", 0.0), AgentTurn((6,) * 4, 3, None, 0.0)))
    res = run_program(fake_vllm.base, "m", prog, time.monotonic(), "infer")
    assert res.error == ""
    assert [r["session_id"] for r in fake_vllm.requests] == ["solo", "solo"]
    assert [len(r["prompt"]) for r in fake_vllm.requests] == [10, 14]
    assert [r["vllm_xargs"].get("tool") for r in fake_vllm.requests] == ["bash", None]
    assert [r["vllm_xargs"]["is_last_turn"] for r in fake_vllm.requests] == [False, True]
    assert [t.already_sent_tokens for t in res.turns] == [0, 10]


# ---- usage errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (["--backend", "vllm", "--executor", "torch"], "--executor torch"),
    (["--backend", "vllm", "--policy", "vanilla,vllm-default"], "vanilla, hintflow-infer, hintflow-infer-pid, hintflow-orchestrator"),
    (["--backend", "vllm", "--nodes", "2"], "--nodes"),
    (["--backend", "vllm", "--policy", "vanilla+disk"], "each optionally with +host"),
    (["--backend", "vllm", "--cost-model", "cpu-tiny", "--plots", "d"], "--cost-model, --plots"),
    (["--model", "m", "--policy", "vllm-default"], "--model applies only with --backend vllm"),
    (["--vllm-python", "py"], "--vllm-python applies only with --backend vllm"),
    (["--rounds", "3"], "--rounds applies only with --backend vllm"),
    (["--bracket"], "--bracket applies only with --backend vllm"),
    (["--backend", "vllm", "--rounds", "0"], "--rounds"),
    (["--backend", "vllm", "--variant", "T=hintflow-orchestrator+host:policy.queue_delay=false"], "ends with '+host'"),
    (["--backend", "vllm", "--variant", "x=hintflow-infer:env.HINTFLOW_TTFT_DEADLNE_S=1"],
     "unknown option 'env.HINTFLOW_TTFT_DEADLNE_S'"),
    (["--backend", "vllm", "--variant", "x=hintflow-infer:env.HINTFLOW_TTFT_DEADLINE_S=1", "-p", "y"],
     "or a --variant (x)"),
])  # fmt: skip
def test_usage_errors(args: list[str], expected: str) -> None:
    res = CliRunner().invoke(replay_command, [*args, "--no-progress"])
    assert res.exit_code == 2, res.output
    assert expected in res.output


def test_missing_model_is_an_error_before_any_server(tmp_path: Path) -> None:
    res = CliRunner().invoke(replay_command, [
        "--backend", "vllm", "-w", "swe-agent", "--programs", "2", "--policy", "vanilla", "--vllm-python",
        "/bin/true", "--model", str(tmp_path / "none"), "--state-dir", str(tmp_path / "s"), "--no-progress"])  # fmt: skip
    assert res.exit_code == 1 and "no config.json" in res.output


# ---- rounds ---------------------------------------------------------------------------------------------
def _summary(jct: float, ttft_p99: float, failed: int = 0) -> dict[str, Any]:
    return {"programs": 3, "failed": failed, "errors": [f"e{jct}"] if failed else [], "turns": 9,
            "jct_mean_s": jct, "jct_p90_s": 2 * jct, "ttft_p50_s": 0.1, "ttft_p99_s": ttft_p99,
            "across_turn_hit_rate": 0.5, "prompt_tokens": 100, "cached_tokens": 50, "note": f"run {jct}"}  # fmt: skip


def test_rounds_give_medians_and_ratios_paired_within_each_round() -> None:
    from replay._vllm_backend import median_rounds, paired_ratios, vllm_table
    from replay._vllm_bench import verdict

    # The machine slows down over the sitting: vanilla 10 -> 20 -> 40 s; hintflow half of it every round.
    runs = [{"vanilla": _summary(v, 1.0), "hintflow-infer": _summary(v / 2, 2.0, failed=int(v == 40))}
            for v in (10.0, 20.0, 40.0)]  # fmt: skip
    med = median_rounds(runs, ["vanilla", "hintflow-infer"])
    assert med["vanilla"]["jct_mean_s"] == 20.0 and med["hintflow-infer"]["jct_p90_s"] == 20.0
    assert med["hintflow-infer"]["failed"] == 1 and med["hintflow-infer"]["errors"] == ["e20.0"]
    assert med["vanilla"]["note"] == "run 10.0" and med["vanilla"]["programs"] == 3  # non-numbers: round 1's
    ratios = paired_ratios(runs)
    assert set(ratios) == {"hintflow-infer"}
    assert ratios["hintflow-infer"]["jct_mean_s"] == {"median": 0.5, "min": 0.5, "max": 0.5, "rounds": [0.5] * 3}
    assert ratios["hintflow-infer"]["ttft_p99_s"]["median"] == 2.0
    table = vllm_table({"policies": med, "rounds": runs, "ratios": ratios})
    assert "10.00 s (0.50×, 0.50-0.50)" in table and "medians of 3 rounds" in table
    assert paired_ratios([{"hintflow-infer": _summary(1.0, 1.0)}]) == {}  # no vanilla: nothing to pair
    # a +host mode is paired with stock's scheduler over the same host tier when that ran
    host = [{"vanilla": _summary(10.0, 1.0), "vanilla+host": _summary(8.0, 1.0), "hintflow-infer+host": _summary(6.0, 1.0)}]
    assert paired_ratios(host)["hintflow-infer+host"]["jct_mean_s"]["median"] == 0.75
    v = verdict(host[0])  # the report's verdict pairs the same way
    assert v["hintflow-infer+host"] == {"stock": "vanilla+host", "jct_mean_ratio": 0.75, "jct_p90_ratio": 0.75,
                                        "ttft_p99_ratio": 1.0}
    assert set(v) == {"hintflow-infer+host"}  # stock rows have nothing to compare with


def test_a_server_whose_port_was_taken_is_started_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import replay._vllm_bench as bench
    from replay._vllm_backend import run_vllm_replay

    calls: list[str] = []

    def run_mode(mode: str, agents: Any, **kw: Any) -> dict[str, Any]:
        calls.append(mode)
        if len(calls) == 1:
            raise RuntimeError("vLLM exited 1: ... Failed to bind to address 127.0.0.1:38097 ...")
        if mode == "hintflow-infer":
            raise RuntimeError("vLLM exited 1: some other start-up failure")
        (tmp_path / "s" / f"{mode}.programs.json").write_text("[]")
        return _summary(1.0, 1.0)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(bench, "ensure_model", lambda python, d: None)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    kw = {"workload": "swe-agent", "num_programs": 2, "vllm_python": "/bin/true", "model": tmp_path / "m",
          "state_dir": tmp_path / "s"}  # fmt: skip
    report = run_vllm_replay(modes=["vanilla"], **kw)
    assert calls == ["vanilla", "vanilla"] and report["policies"]["vanilla"]["jct_mean_s"] == 1.0
    with pytest.raises(RuntimeError, match="some other"):  # anything else is not retried
        run_vllm_replay(modes=["hintflow-infer"], **kw)
    assert calls[2:] == ["hintflow-infer"]


# ---- variants -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("x=hintflow-infer", "no options given"),
    ("x=vanilla:policy.rel_change=0.1", "'vanilla' pushes none"),
    ("x=hintflow-infer:policy.rel_change=0.1", "'hintflow-infer' pushes none"),
    ("x=vanilla:env.HINTFLOW_YIELD_PINS=0", "stock vLLM reads no HINTFLOW_* setting"),
    ("x=continuum:policy.measured_price=maybe", "expected true or false"),
    ("x=continuum:policy.nope=1", "unknown option 'policy.nope'"),
    ("x=continuum:queue_delay=false", "unknown option 'queue_delay'"),
    ("x+host=continuum:policy.queue_delay=false", "does not end with '+host'"),
    ("kvflow=continuum:policy.queue_delay=false", "already taken"),
    ("x=sglang:policy.queue_delay=false", "unknown mode 'sglang'"),
    ("bad name=continuum:policy.queue_delay=false", "expected NAME=MODE"),
])  # fmt: skip
def test_a_bad_vllm_variant_is_an_error_naming_what_is_wrong(text: str, expected: str) -> None:
    from replay._vllm_backend import parse_vllm_variant

    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_vllm_variant(text)


def test_variants_run_as_their_mode_with_their_options_and_pair_with_its_stock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import replay._vllm_bench as bench
    from replay._vllm_backend import parse_modes, parse_vllm_variant, run_vllm_replay

    t = parse_vllm_variant("T+host=hintflow-orchestrator+host:policy.measured_price=false")
    # an earlier variant as the base: its options carry over, the new ones on top
    d = parse_vllm_variant("TD+host=T+host:env.HINTFLOW_TTFT_DEADLINE_S=1.5,policy.queue_delay=false", [t])
    assert d.mode == "hintflow-orchestrator+host" and d.env == (("HINTFLOW_TTFT_DEADLINE_S", "1.5"),)
    assert d.policy_options == (("measured_price", False), ("queue_delay", False))
    modes = parse_modes("vanilla+host,hintflow-orchestrator+host,TD+host", [t, d])
    calls: list[tuple[str, dict[str, Any]]] = []

    def run_mode(mode: str, agents: Any, **kw: Any) -> dict[str, Any]:
        calls.append((mode, kw))
        (tmp_path / "s" / f"{kw['label']}.programs.json").write_text("[]")
        return _summary({"vanilla+host": 10.0, "hintflow-orchestrator+host": 8.0}.get(kw["label"], 6.0), 1.0)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(bench, "ensure_model", lambda python, d: None)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    report = run_vllm_replay(workload="swe-agent", num_programs=2, vllm_python="/bin/true", model=tmp_path / "m",
                             state_dir=tmp_path / "s", modes=modes, variants=[t, d], rounds=2)  # fmt: skip
    first = {kw["label"]: (mode, kw["policy_options"], kw["hint_env"]) for mode, kw in calls[:3]}
    assert first == {
        "vanilla+host": ("vanilla+host", (), {}),
        "hintflow-orchestrator+host": ("hintflow-orchestrator+host", (), {}),
        "TD+host": ("hintflow-orchestrator+host", (("measured_price", False), ("queue_delay", False)),
                    {"HINTFLOW_TTFT_DEADLINE_S": "1.5"}),
    }  # fmt: skip
    assert [kw["label"] for _, kw in calls[3:]] == modes[::-1]  # round 2 in reverse, the variant among them
    assert report["ratios"]["TD+host"]["jct_mean_s"]["median"] == 0.6  # paired with vanilla+host
    assert report["config"]["variants"] == {"TD+host": {
        "mode": "hintflow-orchestrator+host", "policy_options": {"measured_price": False, "queue_delay": False},
        "env": {"HINTFLOW_TTFT_DEADLINE_S": "1.5"}}}  # fmt: skip


def test_bracket_puts_stock_either_side_of_every_mode_and_pairs_each_run_with_its_neighbours() -> None:
    from replay._vllm_backend import bracketed_ratios, sitting_order

    modes = ["vanilla", "hintflow-infer", "continuum"]
    assert sitting_order(modes, 0) == modes and sitting_order(modes, 1) == modes[::-1]
    assert sitting_order(modes, 0, bracket=True) == ["vanilla", "hintflow-infer", "vanilla", "continuum", "vanilla"]
    assert sitting_order(modes, 1, bracket=True) == ["vanilla", "continuum", "vanilla", "hintflow-infer", "vanilla"]
    # two memory points: each mode between runs of its own stock
    both = ["vanilla", "vanilla+host", "hintflow-infer", "hintflow-infer+host"]
    assert sitting_order(both, 0, bracket=True) == [
        "vanilla", "hintflow-infer", "vanilla", "vanilla+host", "hintflow-infer+host", "vanilla+host"]
    assert sitting_order(["vanilla"], 0, bracket=True) == ["vanilla"]  # nothing to bracket: stock once
    # The machine slows down linearly through the round (stock 10, 20, 30 s); hintflow is 0.5x and
    # continuum 0.8x of what stock would take at their moment. Paired with the round's one stock figure
    # (its median, 20 s), continuum would look 1.2x; with its neighbours it is 0.8x.
    seq = [[("vanilla", _summary(10.0, 1.0)), ("hintflow-infer", _summary(7.5, 1.0)), ("vanilla", _summary(20.0, 1.0)),
            ("continuum", _summary(20.0, 1.0)), ("vanilla", _summary(30.0, 1.0))]]  # fmt: skip
    ratios = bracketed_ratios(seq)
    assert set(ratios) == {"hintflow-infer", "continuum"}
    assert ratios["hintflow-infer"]["jct_mean_s"]["median"] == pytest.approx(0.5)
    assert ratios["continuum"]["jct_mean_s"]["median"] == pytest.approx(0.8)
    # a run with stock on one side only (a round cut short) is paired with that side
    assert bracketed_ratios([seq[0][:2]])["hintflow-infer"]["jct_mean_s"]["rounds"] == [0.75]


def test_bracketed_sitting_runs_stock_between_modes_and_reports_the_sequence(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import replay._vllm_bench as bench
    from replay._vllm_backend import run_vllm_replay, vllm_table

    labels: list[str] = []

    def run_mode(mode: str, agents: Any, **kw: Any) -> dict[str, Any]:
        labels.append(kw["label"])
        (tmp_path / "s" / f"{kw['label']}.programs.json").write_text(f'["{len(labels)}"]')
        # stock slows by 10 s a run; hintflow takes half of what stock takes at its moment
        return _summary(10.0 * len(labels) if mode == "vanilla" else 5.0 * len(labels), 1.0)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(bench, "ensure_model", lambda python, d: None)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    report = run_vllm_replay(workload="swe-agent", num_programs=2, vllm_python="/bin/true", model=tmp_path / "m",
                             state_dir=tmp_path / "s", modes=["vanilla", "hintflow-infer"], bracket=True)  # fmt: skip
    assert labels == ["vanilla", "hintflow-infer", "vanilla"]
    assert report["ratios"]["hintflow-infer"]["jct_mean_s"]["median"] == pytest.approx(0.5)
    assert report["policies"]["vanilla"]["jct_mean_s"] == 20.0  # the median of stock's runs (10, 30)
    assert [row["mode"] for row in report["sequence"][0]] == labels
    assert report["programs"]["vanilla"] == ["1"]  # each mode's first run
    assert "either side of each run" in vllm_table(report) and report["config"]["bracket"] is True


def test_bracket_without_its_stock_mode_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from replay._vllm_backend import run_vllm_replay

    with pytest.raises(ValueError, match=r"add vanilla to the policies \(kvflow would"):
        run_vllm_replay(workload="swe-agent", num_programs=2, vllm_python="/bin/true", model=tmp_path / "absent",
                        state_dir=tmp_path / "s", modes=["kvflow", "vanilla+host", "hintflow-infer+host"],
                        bracket=True)  # fmt: skip
    assert not (tmp_path / "s").exists()


# ---- against real vLLM servers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_python() -> str:
    from tests.vllm_support import vllm_python_or_skip

    return vllm_python_or_skip()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replay_against_real_vllm(tmp_path: Path, vllm_python: str) -> None:
    # One mode: each starts a server of its own (about 45 s here); the stock mode differs only in the
    # scheduler class it names, which the vLLM backend's tests start for real.
    trace = tmp_path / "three.jsonl"
    dump_jsonl(_trace_programs(), trace)
    out = tmp_path / "report.json"
    res = CliRunner().invoke(replay_command, [
        "--backend", "vllm", "-w", f"hintflow:{trace}", "--policy", "hintflow-infer+host",
        "--host-capacity-tokens", str(64 * 128), "--kv-capacity-tokens", str(40 * 128), "--vllm-python", vllm_python, "--state-dir", str(tmp_path / "state"),
        "--json", str(out), "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "| hintflow-infer+host |" in res.output
    assert "40 blocks of 128" in res.output and "host tier of +host policies 8,192 tokens" in res.output
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["hintflow-infer+host"]
    assert report["config"]["num_gpu_blocks"] == 40
    for mode, summary in report["policies"].items():
        assert (summary["programs"], summary["failed"], summary["turns"]) == (3, 0, 9), (mode, summary)
        runs = report["programs"][mode]
        assert sorted(r["program"] for r in runs) == ["p0", "p1", "p2"]
        assert all(r["error"] == "" and len(r["turns"]) == 3 for r in runs), runs
    for run in report["programs"]["hintflow-infer+host"]:
        later = run["turns"][1:]
        assert all(t["cached_tokens"] >= 256 for t in later), run  # at least two blocks of the last prompt
        assert [t["prompt_tokens"] for t in run["turns"]] == sorted(t["prompt_tokens"] for t in run["turns"])
    assert report["policies"]["hintflow-infer+host"]["across_turn_hit_rate"] > 0.5
    assert report["policies"]["hintflow-infer+host"]["preemptions"] >= 0  # read from the server's /metrics


async def test_node_readings_average_a_busy_node_s_cache_state(start_engine: Any) -> None:
    """The harness samples a hintflow node's measured-price readings over its hint port while it has work
    (here a real torch node serving the same CacheState as a vLLM node's sidecar)."""
    import asyncio

    from replay._vllm_readings import NodeReadings

    node = await start_engine("readings")
    readings = NodeReadings(node.address, period_s=0.02)
    for i in range(8):  # prompts to prefill and tokens to decode: both kinds of step
        node.core.submit([(7 * i + t) % 250 + 1 for t in range(300)], 48, session_id=f"s{i}")
    deadline = time.monotonic() + 60
    while node.core.has_work() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    got = await asyncio.to_thread(readings.stop)
    assert not node.core.has_work()
    assert got["node_readings"] >= 1 and readings.num_failed == 0
    assert 0.0 < got["node_prefill_share"] < 1.0
    assert got["node_unpinned_kept"] == 0.0  # no session came back


def test_node_readings_of_a_node_that_never_answers_say_nothing() -> None:
    from replay._vllm_readings import NodeReadings

    readings = NodeReadings("127.0.0.1:1", period_s=0.01)  # nothing listens there
    time.sleep(0.1)
    assert readings.stop() == {} and readings.num_failed >= 1


def test_a_counter_is_read_from_a_server_s_metrics_summed_over_its_labels() -> None:
    import http.server
    import threading

    from replay._vllm_bench import vllm_counter

    body = (b"# HELP vllm:num_preemptions_total Cumulative number of preemptions.\n"
            b"# TYPE vllm:num_preemptions_total counter\n"
            b'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
            b'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0\n'
            b'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9\n')  # fmt: skip

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert vllm_counter(base, "vllm:num_preemptions_total") == 5.0
        assert vllm_counter(base, "vllm:no_such_counter") is None
    finally:
        server.shutdown()
        server.server_close()
    assert vllm_counter(base, "vllm:num_preemptions_total") is None  # nobody answers: nothing, no error
