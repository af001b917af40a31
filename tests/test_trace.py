"""Agent-workload traces: the data model's validation, JSONL round trip and error lines, the Mooncake and TRIE
readers, and the generators' statistics (turns, pause mean/sd, context growth, joins, Poisson arrivals)."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

import pytest

from replay import (
    GENERATORS,
    MOONCAKE_BLOCK_SIZE,
    Program,
    Session,
    TraceError,
    Turn,
    capped_lognormal_moments,
    dump_jsonl,
    generate,
    load_jsonl,
    lognormal_params,
    poisson_arrivals,
    read_mooncake,
    read_trie,
    read_workload,
)

CONVERSATION = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace_2000.jsonl"


def one_session(*turns: Turn, program_id: str = "p") -> Program:
    return Program(program_id, 0.0, "test", [Session("s", "agent", list(turns))])


def write_lines(tmp_path: Path, lines: Sequence[object], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def good_line(program_id: str = "p1", **turn: object) -> dict:
    return {"program_id": program_id, "arrival_s": 1.5, "workload": "test", "sessions": [
        {"session_id": "a", "role": "agent", "turns": [{"input_tokens": 10, "output_tokens": 2} | turn]}]}


# --- data model -------------------------------------------------------------------------------------------


def test_context_and_totals() -> None:
    s = Session("s", "agent", [Turn(100, 10, "bash", 0.5), Turn(50, 20, "bash", 1.0), Turn(5, 7)])
    assert s.context_tokens() == [100, 160, 185]  # 100; +10 out +50 in; +20 out +5 in
    assert s.total_tokens == 192
    p = Program("p", 2.0, "test", [s])
    assert (p.num_turns, p.total_tokens, p.max_context_tokens, p.roots) == (3, 192, 185, ["s"])
    assert isinstance(s.turns, tuple) and s.after == ()


def test_dag_helpers() -> None:
    a = Session("a", "planner", [Turn(5, 1)])
    b = Session("b", "worker", [Turn(5, 1)], after=["a"])
    c = Session("c", "worker", [Turn(5, 1)], after=["a"])
    d = Session("d", "reviewer", [Turn(5, 1)], after=["c", "b"], join="or")
    p = Program("p", 0, "test", [d, c, b, a])
    assert p.topological_order() == ["a", "c", "b", "d"]
    assert p.successors("a") == ["c", "b"] and p.roots == ["a"]
    assert p.session("d").join == "or"
    with pytest.raises(KeyError, match="no session 'x'"):
        p.session("x")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Turn(-1, 0), "input_tokens must be an integer >= 0, got -1"),
        (lambda: Turn(1, True), "output_tokens must be an integer"),  # type: ignore[arg-type]
        (lambda: Turn(1, 1, "bash", math.nan), "tool_duration_s must be a finite number"),
        (lambda: Turn(1, 1, "bash", -0.1), "tool_duration_s must be a finite number"),
        (lambda: Turn(1, 1, None, 2.0), "tool_duration_s must be 0 when tool is None"),
        (lambda: Turn(1, 1, ""), "tool must be a non-empty string"),
        (lambda: Turn(10, 1, shared_prefix="sys"), "shared_prefix and shared_prefix_tokens > 0 go together"),
        (lambda: Turn(10, 1, shared_prefix="sys", shared_prefix_tokens=11), "must not exceed input_tokens"),
        (lambda: Turn(10, 1, hash_ids=(1, 2)), "block_size must be an integer >= 1"),
        (lambda: Turn(10, 1, block_size=4), "block_size .* is set but hash_ids is empty"),
        (lambda: Session("s", "agent", []), "session 's': turns must not be empty"),
        (lambda: Session("s", "agent", [Turn(0, 1)]), "session 's': turn 0: input_tokens must be >= 1"),
        (lambda: Session("s", "agent", [Turn(1, 1), Turn(5, 1, shared_prefix="k", shared_prefix_tokens=2)]),
         "turn 1: only the first turn may have a shared_prefix"),
        (lambda: Session("s", "agent", [Turn(1, 1)], after=["s"]), "after names the session itself"),
        (lambda: Session("s", "a", [Turn(1, 1)], join="xor"),  # type: ignore[arg-type]
         "join must be 'and' or 'or'"),
        (lambda: Program("p", -1.0, "w", [Session("s", "a", [Turn(1, 1)])]), "program 'p': arrival_s"),
        (lambda: Program("p", 0, "w", []), "program 'p': sessions must not be empty"),
        (lambda: Program("p", 0, "w", [Session("s", "a", [Turn(1, 1)])] * 2), "duplicate session id 's'"),
        (lambda: Program("p", 0, "w", [Session("s", "a", [Turn(1, 1)], after=["x"])]),
         r"program 'p': session 's': after names unknown sessions \['x'\]"),
        (lambda: Program("p", 0, "w", [Session("a", "r", [Turn(1, 1)], after=["b"]),
                                       Session("b", "r", [Turn(1, 1)], after=["a"]),
                                       Session("c", "r", [Turn(1, 1)])]),
         r"program 'p': the after dependencies have a cycle among sessions \['a', 'b'\]"),
        (lambda: Program("p", 0, "w", [
            Session("a", "r", [Turn(5, 1, shared_prefix="k", shared_prefix_tokens=2)]),
            Session("b", "r", [Turn(5, 1, shared_prefix="k", shared_prefix_tokens=3)])]),
         "shared_prefix 'k' has two lengths"),
    ],
)
def test_validation_names_the_field(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


# --- our JSONL format -------------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    programs = (
        generate("swe-agent", seed=3, num_programs=5)
        + generate("multi-agent", seed=3, num_programs=5)
        + generate("human-in-loop", seed=3, num_programs=5, scale=0.1)
        + read_mooncake(CONVERSATION, limit=5)
    )
    path = tmp_path / "out.jsonl"
    dump_jsonl(programs, path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(programs)
    first_turn = json.loads(lines[0])["sessions"][0]["turns"][0]
    assert first_turn["tool"] == "bash" and first_turn["shared_prefix"] == "swe-agent/system"
    assert "hash_ids" not in first_turn  # defaults are left out
    assert load_jsonl(path) == programs
    assert load_jsonl(path, limit=3) == programs[:3]
    assert read_workload(str(path), seed=0) == sorted(programs, key=lambda p: p.arrival_s)
    two = read_workload(f"hintflow:{path}", seed=0, limit=2)
    assert two == sorted(programs[:2], key=lambda p: p.arrival_s)


def test_optional_keys_default(tmp_path: Path) -> None:
    (p,) = load_jsonl(write_lines(tmp_path, [good_line()]))
    assert p.sessions[0].turns[0] == Turn(10, 2) and p.sessions[0].after == () and p.sessions[0].join == "and"
    assert p.arrival_s == 1.5


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"program_id": "p2", ', "not valid JSON"),
        ("[1, 2]", "program must be a JSON object, got list"),
        (good_line("p2", input_tokens=-5),
         "program 'p2': session 'a': turn 0: input_tokens must be an integer >= 0"),
        (good_line("p2", tool="bash", tool_duration_s=math.nan),
         "turn 0: tool_duration_s must be a finite number"),
        (good_line("p2", tool_duration_s=1.0), "tool_duration_s must be 0 when tool is None"),
        (good_line("p2", input_token=5), r"turn 0: unknown keys \['input_token'\]"),
        ({"program_id": "p2", "arrival_s": 0, "workload": "w"}, "program: missing 'sessions'"),
        (good_line("p1"), "program id 'p1' already used on line 1"),
        (good_line("p2", shared_prefix="sys", shared_prefix_tokens=3), None),  # fine alone, clashes below
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]},
         "read it as mooncake:FILE"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: object, message: str | None) -> None:
    lines = [good_line("p1"), "", bad]  # the blank line still counts: the bad one is line 3
    if message is None:  # a shared prefix used with two lengths across lines
        lines.append(good_line("p3", shared_prefix="sys", shared_prefix_tokens=4))
        message = "shared_prefix 'sys' has 4 tokens here but 3 on an earlier line"
    path = write_lines(tmp_path, lines)
    with pytest.raises(TraceError, match=message) as info:
        load_jsonl(path)
    assert info.value.path == str(path) and info.value.line == len(lines)
    assert str(info.value).startswith(f"{path}:{len(lines)}: ")


def test_cycle_and_unknown_after_in_file(tmp_path: Path) -> None:
    line = good_line("p")
    line["sessions"].append({"session_id": "b", "role": "r", "after": ["a", "zz"],
                             "turns": [{"input_tokens": 1, "output_tokens": 1}]})
    unknown = r":1: program 'p': session 'b': after names unknown sessions \['zz'\]"
    with pytest.raises(TraceError, match=unknown):
        load_jsonl(write_lines(tmp_path, [line]))
    line["sessions"][1]["after"] = ["a"]
    line["sessions"][0]["after"] = ["b"]
    with pytest.raises(TraceError, match=r":1: program 'p': the after dependencies have a cycle"):
        load_jsonl(write_lines(tmp_path, [line]))


# --- Mooncake ---------------------------------------------------------------------------------------------


def test_mooncake_real_trace() -> None:
    programs = read_workload(f"mooncake:{CONVERSATION}", seed=0, limit=200)
    raw = [json.loads(line) for line in itertools.islice(CONVERSATION.open(), 200)]
    assert len(programs) == 200
    for p, r in zip(programs, raw, strict=True):
        (turn,) = p.sessions[0].turns
        assert p.arrival_s == r["timestamp"] / 1000 and p.workload == "mooncake"
        assert (turn.input_tokens, turn.output_tokens) == (r["input_length"], r["output_length"])
        assert list(turn.hash_ids) == r["hash_ids"] and turn.block_size == MOONCAKE_BLOCK_SIZE == 512
        assert len(turn.hash_ids) == math.ceil(turn.input_tokens / 512)
    arrivals = [p.arrival_s for p in programs]
    assert arrivals[-1] > 0 and arrivals == sorted(arrivals)
    # shared prefixes are visible: every request starts with block 0, and some share many more blocks
    ids = [p.sessions[0].turns[0].hash_ids for p in programs]
    assert all(i[0] == 0 for i in ids)

    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    assert max(common(a, b) for a, b in itertools.combinations(ids, 2)) >= 10


def test_mooncake_bad_line(tmp_path: Path) -> None:
    good = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2], "extra": 1}
    path = write_lines(tmp_path, [good, {"timestamp": 6, "input_length": 600, "output_length": 3}])
    with pytest.raises(TraceError, match=r":2: request: missing 'hash_ids'"):
        read_mooncake(path)
    path = write_lines(tmp_path, [good, good | {"input_length": -1}])
    with pytest.raises(TraceError, match=r":2: input_length must be an integer >= 0"):  # the file's own key
        read_mooncake(path)
    path = write_lines(tmp_path, [good, good | {"hash_ids": [1, 2, 3]}])
    with pytest.raises(TraceError, match=r":2: hash_ids has 3 entries, but input_length 600 is 2 blocks"):
        read_mooncake(path)
    (p,) = read_mooncake(path, limit=1)
    assert p.arrival_s == 0.005 and p.sessions[0].turns[0].hash_ids == (1, 2)


# --- TRIE -------------------------------------------------------------------------------------------------

TRIE_LINES = [
    {"num_turns": 2, "input_prompt_length": 8000, "assistant_response_length": [150, 12],
     "tool_call_output_length": [50, 1100], "tool_call_latency": [0.685, 2.5],
     "final_assistant_response_length": 1600},
    {"num_turns": 0, "input_prompt_length": 900, "assistant_response_length": [],
     "tool_call_output_length": [], "tool_call_latency": [], "final_assistant_response_length": 40},
    # lenient: no num_turns (the lists agree), final response as an extra list entry
    {"input_prompt_length": 700, "assistant_response_length": [30, 9], "tool_call_output_length": [20],
     "tool_call_latency": [1]},
]


def test_trie_reader(tmp_path: Path) -> None:
    path = write_lines(tmp_path, TRIE_LINES, "trie.jsonl")
    a, b, c = read_trie(path)
    assert a.sessions[0].turns == (
        Turn(8000, 150, "tool", 0.685), Turn(50, 12, "tool", 2.5), Turn(1100, 1600))
    assert a.sessions[0].context_tokens() == [8000, 8200, 9312]
    assert b.sessions[0].turns == (Turn(900, 40),)
    assert c.sessions[0].turns == (Turn(700, 30, "tool", 1.0), Turn(20, 9))
    assert {p.workload for p in (a, b, c)} == {"trie"} and {p.arrival_s for p in (a, b, c)} == {0.0}
    assert not any(t.shared_prefix or t.hash_ids for p in (a, b, c) for t in p.sessions[0].turns)
    timed = read_workload(f"trie:{path}", seed=1, rate=2.0, scale=0.5)
    assert [p.program_id for p in timed] == ["trie-1", "trie-2", "trie-3"]
    assert 0 < timed[0].arrival_s < timed[1].arrival_s < timed[2].arrival_s
    assert timed[0].sessions[0].turns[0] == Turn(4000, 75, "tool", 0.685)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_turns": 3},
         r"each list must have num_turns = 3 entries, got \{'assistant_response_length': 2"),
        ({"tool_call_latency": [0.5]}, "each list must have num_turns = 2 entries"),
        ({"tool_call_latency": [0.5, -1]}, r"tool_call_latency\[1\] must be a number of seconds >= 0"),
        ({"assistant_response_length": [5, "x"]}, r"assistant_response_length\[1\] must be an integer >= 0"),
        ({"final_assistant_response_length": None}, "missing 'final_assistant_response_length'"),
        ({"num_turns": "2"}, "num_turns must be an integer >= 0"),
        ({"tool_call_output_length": 50}, "tool_call_output_length must be a list"),
        ({"input_prompt_length": 0}, "input_prompt_length must be an integer >= 1"),
        ({"num_turn": 2}, r"unknown keys \['num_turn'\]"),
    ],
)
def test_trie_bad_line(tmp_path: Path, change: dict, message: str) -> None:
    path = write_lines(tmp_path, [TRIE_LINES[1], TRIE_LINES[0] | change], "trie.jsonl")
    with pytest.raises(TraceError, match=f":2: .*{message}"):
        read_trie(path)


# --- distributions and arrivals ---------------------------------------------------------------------------


def test_lognormal_fit() -> None:
    mu, sigma = lognormal_params(0.9, 3.5)  # uncapped: the textbook inversion
    assert sigma == pytest.approx(math.sqrt(math.log(1 + (3.5 / 0.9) ** 2)))
    assert mu == pytest.approx(math.log(0.9) - sigma**2 / 2)
    assert capped_lognormal_moments(mu, sigma, 1e12) == pytest.approx((0.9, 3.5), rel=1e-6)
    mu, sigma = lognormal_params(0.9, 3.5, 120.0)  # capped: fitted so the capped samples match
    assert capped_lognormal_moments(mu, sigma, 120.0) == pytest.approx((0.9, 3.5), rel=1e-6)
    rng = random.Random(7)
    samples = [min(120.0, rng.lognormvariate(mu, sigma)) for _ in range(50_000)]
    assert statistics.fmean(samples) == pytest.approx(0.9, rel=0.05)
    assert statistics.pstdev(samples) == pytest.approx(3.5, rel=0.10)
    with pytest.raises(ValueError, match="no lognormal capped at 2"):
        lognormal_params(1.0, 10.0, 2.0)


def test_poisson_arrivals() -> None:
    times = poisson_arrivals(20_000, 2.0, random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.05)  # exponential: sd = mean
    programs = read_workload("swe-agent", seed=4, rate=5.0, limit=2000)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(programs)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.1)
    with pytest.raises(ValueError, match="rate must be"):
        poisson_arrivals(3, 0.0, random.Random(1))


# --- generators -------------------------------------------------------------------------------------------


def test_swe_agent_statistics() -> None:
    programs = generate("swe-agent", seed=11, num_programs=5000)
    assert statistics.fmean(p.num_turns for p in programs) == pytest.approx(11, abs=0.2)
    assert min(p.num_turns for p in programs) >= 8 and max(p.num_turns for p in programs) <= 14
    pauses = [t.tool_duration_s for p in programs for t in p.sessions[0].turns if t.tool is not None]
    assert len(pauses) > 45_000 and {t.tool for p in programs for t in p.sessions[0].turns} == {"bash", None}
    assert statistics.fmean(pauses) == pytest.approx(0.9, rel=0.05)
    assert statistics.pstdev(pauses) == pytest.approx(3.5, rel=0.10)
    assert statistics.median(pauses) < 0.3 and max(pauses) <= 120.0  # heavy tail, capped
    final_context = [p.max_context_tokens for p in programs]
    assert 20_000 <= statistics.fmean(final_context) <= 40_000
    first = [p.sessions[0].turns[0] for p in programs]
    assert all(3000 <= t.input_tokens <= 6000 and t.shared_prefix == "swe-agent/system" for t in first)
    assert all(t.tool is None for p in programs for t in p.sessions[0].turns[-1:])


def test_generators_are_deterministic() -> None:
    for name in GENERATORS:
        a = generate(name, seed=5, num_programs=20)
        assert a == generate(name, seed=5, num_programs=20)
        assert a != generate(name, seed=6, num_programs=20)
        assert generate(name, seed=5, num_programs=10) == a[:10]  # more programs keep the first ones
        slower = generate(name, seed=5, num_programs=20, rate=0.01)
        assert [p.sessions for p in slower] == [p.sessions for p in a]  # the rate moves arrivals only
        assert slower[-1].arrival_s > a[-1].arrival_s
        assert [p.program_id for p in a] == [f"{name}-{i}" for i in range(20)]


def test_multi_agent_joins() -> None:
    programs = generate("multi-agent", seed=2, num_programs=400)
    joins = []
    prefixes: dict[str, int] = {}
    for p in programs:
        ids = [s.session_id for s in p.sessions]
        workers = [s for s in p.sessions if s.role == "worker"]
        assert ids[0] == "planner" and ids[-1] == "reviewer" and 2 <= len(workers) <= 4
        assert p.roots == ["planner"] and p.topological_order() == ids
        assert all(w.after == ("planner",) for w in workers)
        reviewer = p.session("reviewer")
        assert set(reviewer.after) == {w.session_id for w in workers}
        joins.append(reviewer.join)
        finals = [w.turns[-1].output_tokens for w in workers]
        new = reviewer.turns[0].input_tokens - reviewer.turns[0].shared_prefix_tokens
        assert new == (sum(finals) if reviewer.join == "and" else max(finals))
        for s in p.sessions:
            t0 = s.turns[0]
            assert t0.shared_prefix == f"multi-agent/{s.role}"
            assert prefixes.setdefault(t0.shared_prefix, t0.shared_prefix_tokens) == t0.shared_prefix_tokens
            assert all(t.tool == "python" for t in s.turns[:-1]) and s.turns[-1].tool is None
    assert set(joins) == {"and", "or"}
    assert joins.count("or") / len(joins) == pytest.approx(0.25, abs=0.07)
    assert prefixes == {"multi-agent/planner": 1500, "multi-agent/worker": 1200, "multi-agent/reviewer": 1000}


def test_human_in_loop_pauses_minutes() -> None:
    programs = generate("human-in-loop", seed=8, num_programs=1000)
    pauses = [t.tool_duration_s for p in programs for t in p.sessions[0].turns if t.tool == "human"]
    assert 60 <= statistics.median(pauses) <= 300 and max(pauses) <= 3600
    assert statistics.fmean(pauses) == pytest.approx(300, rel=0.1)


def test_scale_reduces_tokens() -> None:
    full = generate("swe-agent", seed=9, num_programs=30)
    small = read_workload("swe-agent", seed=9, limit=30, scale=0.01)
    for f, s in zip(full, small, strict=True):
        assert f.arrival_s == s.arrival_s and f.num_turns == s.num_turns
        for tf, ts in zip(f.sessions[0].turns, s.sessions[0].turns, strict=True):
            assert ts.input_tokens == max(1, round(tf.input_tokens * 0.01)) and ts.output_tokens >= 1
            assert ts.tool_duration_s == tf.tool_duration_s
            assert ts.shared_prefix_tokens <= ts.input_tokens
        assert s.total_tokens < f.total_tokens / 50
    assert {p.sessions[0].turns[0].shared_prefix_tokens for p in small} == {20}
    mooncake = read_workload(f"mooncake:{CONVERSATION}", seed=0, limit=3, scale=0.25)
    assert mooncake[0].sessions[0].turns[0].block_size == 128
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        full[0].scaled(0)


def test_workload_specs(tmp_path: Path) -> None:
    short = read_workload("swe-agent:num_turns=3,tool_mean_s=2.0", seed=1, limit=20)
    assert {p.num_turns for p in short} == {3}
    workers = read_workload("multi-agent:num_workers=5-5,or_join_fraction=0", seed=1, limit=5)
    assert all(p.num_sessions == 7 and p.sessions[-1].join == "and" for p in workers)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        read_workload("nope", seed=0)
    with pytest.raises(ValueError, match="swe-agent: expected key=value"):
        read_workload("swe-agent:bogus=1", seed=0)
    with pytest.raises(ValueError, match="bad value for num_turns"):
        read_workload("swe-agent:num_turns=a-b", seed=0)
    with pytest.raises(ValueError, match="num_turns must be a range"):
        read_workload("swe-agent:num_turns=5-2", seed=0)
    with pytest.raises(ValueError, match=r"unknown parameters \['bogus'\]"):
        generate("swe-agent", seed=0, bogus=1)
    mooncake_as_ours = write_lines(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 1,
                                               "hash_ids": [0]}])
    with pytest.raises(TraceError, match="read it as mooncake:FILE"):
        read_workload(str(mooncake_as_ours), seed=0)
