"""The replay harness: deterministic, complete, join-correct, leak-free, and its report and CLI shapes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay import (
    REPLAY_CONFIGS,
    REQUIRED_KEYS,
    Program,
    ReplaySetup,
    Session,
    Turn,
    generate,
    get_replay_config,
    replay_command,
    report_json,
    run_replay,
)

ALL = list(REPLAY_CONFIGS.values())


def _tiny(n: int = 6) -> list[Program]:
    return generate("swe-agent", seed=3, num_programs=n, rate=2.0, scale=0.05)


def _setup(**kw: object) -> ReplaySetup:
    base: dict[str, object] = {"block_size": 16, "num_nodes": 2}
    base.update(kw)
    return ReplaySetup(**base)  # type: ignore[arg-type]


def _strip_wall(report: dict) -> dict:
    for m in report["policies"].values():
        m.pop("wall_s")
    return report


def test_same_trace_replays_identically() -> None:
    configs = [get_replay_config("vllm-default"), get_replay_config("hintflow")]
    a = report_json(*run_replay(_setup(), configs, programs=_tiny()))
    b = report_json(*run_replay(_setup(), configs, programs=_tiny()))
    assert json.dumps(_strip_wall(a), sort_keys=True) == json.dumps(_strip_wall(b), sort_keys=True)


def test_policies_in_worker_processes_give_the_same_report() -> None:
    configs = [get_replay_config("vllm-default"), get_replay_config("kvflow"), get_replay_config("hintflow")]
    seen: list[tuple[str, int]] = []

    def progress(name: str, total: int):  # type: ignore[no-untyped-def]
        return lambda n: seen.append((name, n))

    one = report_json(*run_replay(_setup(), configs, programs=_tiny()))
    setup, results = run_replay(_setup(), configs, programs=_tiny(), jobs=2, progress=progress)
    assert [r.config.name for r in results] == [c.name for c in configs]  # the order asked for
    assert all(not r.nodes and len(r.node_totals) == 2 for r in results)  # engines stayed in the workers
    assert sorted(seen) == sorted((c.name, 6) for c in configs)  # one tick per finished policy
    two = report_json(setup, results)
    assert json.dumps(_strip_wall(one), sort_keys=True) == json.dumps(_strip_wall(two), sort_keys=True)
    assert one["policies"]["vllm-default"]["recomputed_tokens"] > 0  # (the runs did something)


@pytest.fixture(scope="module")
def all_results():  # type: ignore[no-untyped-def]
    programs = _tiny(8)
    return programs, run_replay(_setup(), ALL, programs=programs)


def test_every_policy_completes_every_program_and_turn(all_results) -> None:  # type: ignore[no-untyped-def]
    programs, (_, results) = all_results
    expected = {p.program_id: p.num_turns for p in programs}
    for r in results:
        got: dict[str, int] = {}
        for t in r.turns:
            got[t.program_id] = got.get(t.program_id, 0) + 1
        assert got == expected, r.config.name
        assert all(run.end_s is not None and run.end_s >= run.arrival_s for run in r.programs)


def test_oracle_never_recomputes_and_vllm_default_does(all_results) -> None:  # type: ignore[no-untyped-def]
    _, (_, results) = all_results
    by = {r.config.name: report_json(_setup(), [r])["policies"][r.config.name] for r in results}
    assert by["oracle"]["recomputed_tokens"] == 0
    assert by["oracle"]["evicted_blocks"] == 0
    assert by["vllm-default"]["recomputed_tokens"] > 0


def test_nodes_hold_invariants_and_leak_nothing(all_results) -> None:  # type: ignore[no-untyped-def]
    _, (_, results) = all_results
    for r in results:
        for node in r.nodes:
            node.engine.check_invariants()
            kv = node.engine.kv
            assert kv.num_pinned_blocks == 0
            assert not node.engine.scheduler.has_work()
            if r.config.hint_policy == "vllm-default" and r.config.retain_contexts:
                # stock vLLM's prefix cache (``vllm-offload``): finished contexts stay cached, every block of
                # them evictable, until a new request needs the memory; nothing else holds any
                held = len({b for s in kv.sessions.values() for b in s.block_ids})  # (shared prefixes once)
                assert kv.device.num_free_blocks + held == kv.device.num_blocks, (r.config.name, node.address)
                assert held and kv.num_evictable_blocks >= held
                continue
            assert kv.device.num_free_blocks == kv.device.num_blocks, (r.config.name, node.address)
            assert kv.host.num_free_blocks == kv.host.num_blocks
            assert all(not s.block_ids and not s.host_block_ids for s in kv.sessions.values())
            if r.config.hint_policy != "vllm-default":  # stock vLLM hears no Release: metadata stays
                assert not kv.sessions, (r.config.name, list(kv.sessions)[:3])


def test_clairvoyant_row_submits_each_turn_with_its_program_s_true_remaining_work(monkeypatch) -> None:
    """The analysis row's priority is the trace's remaining work at batch one (prefill, decode, pauses): it
    shrinks turn by turn, and equals the formula on the first turn; the other rows send no priority."""
    from engine_adapter import EngineCore

    seen: dict[str, list[int | None]] = {}
    submit = EngineCore.submit

    def spy(self, prompt, max_new_tokens, **kw):  # type: ignore[no-untyped-def]
        seen.setdefault(kw["program_id"], []).append(kw.get("priority"))
        return submit(self, prompt, max_new_tokens, **kw)

    monkeypatch.setattr(EngineCore, "submit", spy)
    programs = _tiny(2)
    setup, _ = run_replay(_setup(), [get_replay_config("clairvoyant")], programs=programs)
    cm = setup.cost()
    for p in programs:
        turns = p.sessions[0].turns
        first_s = sum(cm.prefill_time(t.input_tokens) + t.output_tokens * cm.decode_time(1, 0) + t.tool_duration_s
                      for t in turns)
        got = [k for k, _ in itertools.groupby(seen[p.program_id])]  # a migrated turn is submitted again
        assert len(got) == len(turns) and got[0] == round(1000 * first_s)
        assert all(a is not None and b is not None and a > b for a, b in itertools.pairwise(got))
    seen.clear()
    run_replay(_setup(), [get_replay_config("hintflow")], programs=programs)
    assert {x for got in seen.values() for x in got} == {None}


def test_report_has_required_keys(all_results) -> None:  # type: ignore[no-untyped-def]
    _, (setup, results) = all_results
    report = report_json(setup, results)
    assert set(report["policies"]) == set(REPLAY_CONFIGS)
    for m in report["policies"].values():
        assert set(REQUIRED_KEYS) <= set(m)
        assert 0.0 <= m["across_turn_hit_rate"] <= 1.0
    assert report["config"]["kv_capacity_tokens"] > 0
    coeffs = report["config"]["cost_model_coefficients"]  # what priced the steps, at the replay's block size
    assert coeffs["block_size"] == 16 and "offload_overlaps_compute" in coeffs and coeffs["decode_base_s"] > 0


def _pipeline(join: str) -> Program:
    planner = Session("planner", "planner", [Turn(300, 40, shared_prefix="p", shared_prefix_tokens=100)])
    workers = [
        Session(f"w{i}", "worker", [Turn(200 + 50 * i, 30, "python", 0.5 + 4.0 * i), Turn(100, 20 + 30 * i)],
                after=["planner"])
        for i in range(3)
    ]
    reviewer = Session("reviewer", "reviewer", [Turn(250, 30)], after=["w0", "w1", "w2"], join=join)  # type: ignore[arg-type]
    return Program(f"pipe-{join}", 0.0, "multi-agent", [planner, *workers, reviewer])


@pytest.mark.parametrize("join", ["and", "or"])
def test_reviewer_waits_for_its_join(join: str) -> None:
    program = _pipeline(join)
    _, results = run_replay(_setup(), [get_replay_config("hintflow"), get_replay_config("thunderagent")],
                            programs=[program])
    for r in results:
        run = r.programs[0]
        worker_ends = sorted(run.sessions[w].finished_s or 0.0 for w in ("w0", "w1", "w2"))
        reviewer_start = min(t.ready_s for t in r.turns if t.session_key.endswith("/reviewer"))
        gate = worker_ends[-1] if join == "and" else worker_ends[0]
        assert reviewer_start >= gate
        assert reviewer_start == pytest.approx(gate)
        if join == "or":
            assert reviewer_start < worker_ends[-1]


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(replay_command, [
        "--workload", "swe-agent", "--programs", "4", "--scale", "0.05", "--rate", "2",
        "--policy", "vllm-default,hintflow,oracle", "--block-size", "16", "--json", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "vllm-default" in res.output and "hintflow" in res.output
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"vllm-default", "hintflow", "oracle"}
    assert set(REQUIRED_KEYS) <= set(report["policies"]["hintflow"])


def test_cli_bad_input() -> None:
    res = CliRunner().invoke(replay_command, ["--policy", "nope", "--no-progress"])
    assert res.exit_code != 0 and "vllm-default" in res.output
    res = CliRunner().invoke(replay_command, ["--executor", "gpu", "--no-progress"])
    assert res.exit_code != 0 and "torch" in res.output


def test_history_counts_wherever_the_session_ran_before(all_results) -> None:  # type: ignore[no-untyped-def]
    # Every later turn's history is the whole context the session computed before (its last prompt plus
    # all but the last output token), whatever node kept it: vLLM-like nodes forget a finished turn's
    # session, and a node a session moved to never saw it; neither may count that history as new prompt.
    _, (_, results) = all_results
    for r in results:
        by_session: dict[str, list] = {}
        for t in r.turns:
            by_session.setdefault(t.session_key, []).append(t)
        for turns in by_session.values():
            turns.sort(key=lambda t: t.turn_index)
            for prev, t in itertools.pairwise(turns):
                assert t.history_tokens == prev.prompt_tokens + prev.output_tokens - 1, r.config.name
                assert t.recomputed_tokens == t.history_tokens - t.across_hit_tokens, r.config.name


def test_ttft_deadline_reaches_only_hintflows_nodes() -> None:
    configs = [get_replay_config("vllm-default"), get_replay_config("hintflow")]
    _, results = run_replay(_setup(ttft_deadline_s=0.5), configs, programs=_tiny(3))
    got = {r.config.name: r.nodes[0].engine.scheduler.config.ttft_deadline_s for r in results}
    assert got == {"vllm-default": None, "hintflow": 0.5}


def test_queue_anatomy_script_reports_each_policy() -> None:
    """The diagnostic behind the README's queueing figures runs and prints one row per policy asked for."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "queue_anatomy.py"), "--programs", "8",
                        "--rate", "2", "-p", "kvflow,oracle"], capture_output=True, text=True, cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert {"kvflow", "oracle"} <= set(rows)
    assert "%" in rows["kvflow"]


def test_overload_note_fires_only_when_even_the_least_queued_policy_mostly_queued() -> None:
    from replay._report import overload_note

    def pol(jct: float, wait: float) -> dict[str, float]:
        return {"jct_mean_s": jct, "num_programs": 10, "queue_wait_mean_s": wait, "num_turns": 100}

    busy = {"policies": {"a": pol(100.0, 8.0), "b": pol(120.0, 9.0)}}  # 80% and 75% of job time queued
    note = overload_note(busy)
    assert "overloaded" in note and "even b's turns" in note and "75%" in note
    assert overload_note({"policies": {"a": pol(100.0, 8.0), "oracle": pol(50.0, 0.1)}}) == ""
    assert overload_note({"policies": {}}) == ""


def test_llm_d_scores_the_prefix_each_node_s_cache_holds() -> None:
    """llm-d's precise prefix scorer sees blocks a finished turn left in vLLM's free queue (its KV events do):
    without memory pressure it keeps each session where its context is, as session affinity does."""
    programs = _tiny(3)
    setup, results = run_replay(_setup(kv_capacity_tokens=200_000),
                                [get_replay_config("vllm-default"), get_replay_config("llm-d")], programs=programs)
    pol = report_json(setup, results)["policies"]
    assert pol["llm-d"]["evicted_blocks"] == 0 and pol["llm-d"]["session_moves"] == 0
    assert pol["llm-d"]["across_turn_hit_rate"] == pytest.approx(pol["vllm-default"]["across_turn_hit_rate"])


def test_report_tables_carry_every_issue_column_and_thunderagent_counts(all_results) -> None:  # type: ignore[no-untyped-def]
    from replay._report import oracle_note, render_table

    _, (setup, results) = all_results
    report = report_json(setup, results)
    table = render_table(report)
    for column in ("JCT mean", "p50", "p99", "TTFT p50", "within-turn hits", "migrations", "preemptions",
                   "prefill share", "unpinned kept"):
        assert column in table
    for name, pol in report["policies"].items():  # the measured price's readings, over the run
        assert 0.0 < pol["prefill_share"] < 1.0, name  # every node prefilled and decoded
        assert 0.0 <= pol["unpinned_kept_rate"] <= 1.0, name
    assert {"thunderagent_pauses", "thunderagent_restores"} <= set(report["policies"]["thunderagent"])
    assert oracle_note(report) == ""  # the oracle evicted nothing
    report["policies"]["oracle"]["evicted_blocks"] = 3
    assert "oracle evicted 3 blocks" in oracle_note(report)


@pytest.mark.parametrize(("args", "message"), [
    (["-w", "swe-agent:rate=1"], "set rate with --rate"),
    (["-w", "multi-agent:num_programs=3"], "set num_programs with --programs"),
    (["-p", " , "], "no policy given"),
    (["--json", "/nonexistent-dir/r.json"], "directory '/nonexistent-dir' does not exist"),  # before the run
    (["--backend", "vllm", "--json", "/nonexistent-dir/r.json"], "directory '/nonexistent-dir' does not exist"),
])
def test_cli_refuses_misplaced_options(args: list[str], message: str) -> None:
    res = CliRunner().invoke(replay_command, [*args, "--no-progress", "--programs", "2"])
    assert res.exit_code != 0 and message in res.output, res.output


def test_a_hit_rate_of_no_tokens_reads_n_a_in_the_table(all_results) -> None:  # type: ignore[no-untyped-def]
    from replay import render_table

    _, (setup, results) = all_results
    report = report_json(setup, results[:1])
    name = results[0].config.name
    assert "n/a" not in render_table(report)
    report["policies"][name]["history_tokens"] = 0  # e.g. one-turn Mooncake requests: no history at all
    work = render_table(report).split("across-turn hits", 1)[1]  # the second table
    row = next(line for line in work.splitlines() if line.startswith(f"| {name} |"))
    assert row.split("|")[2].strip() == "n/a"


def test_a_host_tier_of_no_bytes_prices_pins_by_re_prefill() -> None:
    """With --host-capacity-tokens 0 nothing can come back from the host: pins are priced by the re-prefill
    they save, as the live runtime does for nodes that report no host blocks (not by a copy that cannot
    happen, which made hintflow pin almost nothing where memory is shortest)."""
    from replay import NodeSpec, Simulation

    cost = _setup().cost()
    for host_tokens, priced_by_copy in ((0, False), (4096, True)):
        sim = Simulation(_tiny(2), get_replay_config("hintflow"), NodeSpec(4096, host_tokens, cost))
        assert (getattr(sim.policy, "host_reload", None) is not None) is priced_by_copy


def test_bound_ranks_each_paused_session_by_its_true_pause(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The bound row sends, at each tool start, the pause the trace says the tool takes as the session's
    next use; hintflow sends its predictions instead."""
    from engine_adapter import EngineCore
    from hints import EvictionOrder

    sent: dict[str, list[float]] = {}
    apply = EngineCore.apply_hints

    def spy(self, hints):  # type: ignore[no-untyped-def]
        for h in hints:
            if isinstance(h, EvictionOrder):
                for e in h.entries:
                    sent.setdefault(e.session_id, []).append(e.next_use_s)
        return apply(self, hints)

    monkeypatch.setattr(EngineCore, "apply_hints", spy)
    programs = _tiny(3)
    run_replay(_setup(), [get_replay_config("bound")], programs=programs)
    truth = {f"{p.program_id}/{s.session_id}": [t.tool_duration_s for t in s.turns if t.tool is not None]
             for p in programs for s in p.sessions}
    assert any(truth.values())
    for key, pauses in truth.items():
        got = sent.get(key, [])
        for pause in pauses:
            assert any(v == pytest.approx(pause) for v in got), (key, pause, got)
    sent.clear()
    run_replay(_setup(), [get_replay_config("hintflow")], programs=programs)
    exact = sum(any(v == pytest.approx(p) for v in sent.get(k, [])) for k, ps in truth.items() for p in ps)
    assert exact < sum(map(len, truth.values()))  # predictions, not the trace's answers


def test_bound_pins_a_paused_context_exactly_until_it_returns() -> None:
    """The bound row's pins know the pause: a pin the policy would hold past the session's true return
    lapses at the return (plus a tick); one that would lapse before it is no pin (it would only hold memory
    the session does not use in time); a session's last turn without a tool is never pinned."""
    from hints import Pin
    from replay import NodeSpec, Simulation

    sim = Simulation(_tiny(2), get_replay_config("bound"), NodeSpec(4096, 0, _setup().cost()))
    sim.clock.advance_to(10.0)
    sim._returns["a"] = 14.0  # in a tool, back at 14 s
    assert sim._true_pin(Pin(session_id="a", ttl_s=60.0)).ttl_s == pytest.approx(4.0 + sim.tick_s)
    assert sim._true_pin(Pin(session_id="a", ttl_s=3.0)).ttl_s == 0.0
    assert sim._true_pin(Pin(session_id="a", ttl_s=0.0)).ttl_s == 0.0
    assert sim._true_pin(Pin(session_id="gone", ttl_s=5.0)).ttl_s == 0.0  # not live: never used again
    # Through a run: every pause the trace has is recorded when its turn ends and dropped when it returns.
    seen: list[float] = []
    true_pin = Simulation._true_pin

    def spy(self: Simulation, pin: Pin) -> Pin:
        seen.extend(self._returns.values())
        return true_pin(self, pin)

    bound = Simulation(_tiny(2), get_replay_config("bound"), NodeSpec(4096, 0, _setup().cost()))
    bound._true_pin = spy.__get__(bound)  # type: ignore[method-assign]
    bound.run()
    assert seen and not bound._returns


@pytest.mark.parametrize(("num_programs", "kept"), [(12, "guard"), (20, "none")])
def test_the_bound_keeps_the_better_of_its_two_admission_choices(num_programs: int, kept: str) -> None:
    """``bound`` is replayed without program admission and with the vLLM node's guard; the row is the run
    with the lower mean JCT, and says which it was (here each choice wins once)."""
    from replay import parse_variant, report_json

    configs = [get_replay_config("bound"), parse_variant("b0=bound:admission_choice=false"),
               parse_variant("b1=bound:admission_choice=false,scheduler.admit_fraction=1.0,"
                             "scheduler.admit_max_wait_s=10")]  # fmt: skip
    setup = _setup(kv_capacity_tokens=3072, host_capacity_tokens=0)
    resolved, results = run_replay(setup, configs, programs=_tiny(num_programs))
    pols = report_json(resolved, results)["policies"]
    none, guard = pols["b0"]["jct_mean_s"], pols["b1"]["jct_mean_s"]
    assert pols["bound"]["jct_mean_s"] == pytest.approx(min(none, guard))
    assert pols["bound"]["admission"] == kept == ("guard" if guard < none else "none")


def test_bound_note_names_the_online_rows_that_beat_the_bound() -> None:
    from replay import bound_note

    row = {"jct_mean_s": 10.0, "jct_p90_s": 20.0}
    report = {"policies": {"bound": dict(row), "hintflow": dict(row), "oracle": {"jct_mean_s": 1.0, "jct_p90_s": 2.0}}}
    assert bound_note(report) == ""
    report["policies"]["hintflow"]["jct_p90_s"] = 19.0
    note = bound_note(report)
    assert "hintflow (p90 19.00 s < 20.00 s)" in note and "oracle" not in note and "mean" not in note


def test_host_memory_is_short_by_default_and_all_on_request() -> None:
    programs = _tiny(6)
    short = _setup().resolve(programs, _setup().cost())
    assert short.kv_capacity_tokens is not None and short.host_capacity_tokens == short.kv_capacity_tokens // 2
    every = _setup(host_memory="all").resolve(programs, _setup().cost())
    assert every.kv_capacity_tokens == short.kv_capacity_tokens
    assert every.host_capacity_tokens is not None and every.host_capacity_tokens > short.host_capacity_tokens
    given = _setup(host_capacity_tokens=123, host_memory="all").resolve(programs, _setup().cost())
    assert given.host_capacity_tokens == 123  # tokens given win
    with pytest.raises(ValueError, match="host_memory must be one of short, all"):
        _setup(host_memory="lots")
    res = CliRunner().invoke(replay_command, ["--host-memory", "lots", "--no-progress"])
    assert res.exit_code == 2 and "'lots' is not one of 'short', 'all'" in res.output


def test_baseline_rows_admit_in_vllms_queue_order_and_hintflows_warm_first() -> None:
    """The baselines' nodes admit as vLLM (and SGLang's FCFS) do: one pass in queue order, and a queued
    turn's kept context left to eviction; hintflow's rows run the engine's warm-first pass and keep it.
    The rule shows in a run: on the same trace the baseline's order differs from itself with the pass."""
    from replay import NodeSpec, Simulation, parse_variant

    cost = _setup().cost()
    for name in ("vllm-default", "vllm-offload", "continuum", "kvflow", "thunderagent", "llm-d"):
        node = Simulation(_tiny(2), get_replay_config(name), NodeSpec(4096, 0, cost)).nodes[0]
        assert node.engine.scheduler.config.warm_first is False, name
        assert node.engine.kv.evict_queued is get_replay_config(name).retain_contexts, name
    for name in ("hintflow", "bound", "clairvoyant"):
        node = Simulation(_tiny(2), get_replay_config(name), NodeSpec(4096, 0, cost)).nodes[0]
        assert node.engine.scheduler.config.warm_first is True, name
        assert node.engine.kv.evict_queued is False, name
    warm = parse_variant("cw=continuum:warm_first=true,evict_queued=false")
    programs = generate("swe-agent", seed=3, num_programs=12, rate=4.0, scale=0.05)  # one node, memory short
    setup = _setup(kv_capacity_tokens=3200, num_nodes=1)
    a = report_json(*run_replay(setup, [get_replay_config("continuum"), warm], programs=programs))["policies"]
    assert a["continuum"]["jct_mean_s"] != a["cw"]["jct_mean_s"]


def test_without_resent_outputs_a_prompt_extends_the_last_prompt() -> None:
    """``resend_outputs=false`` (the vLLM benchmark's client, which the mirrors of its nodes replay): a turn's
    prompt is the last prompt and its own new tokens; on (every registered row) the last output is in it too."""
    from replay import parse_variant

    progs = _tiny(4)
    configs = [get_replay_config("vllm-default"), parse_variant("nores=vllm-default:resend_outputs=false")]
    _, results = run_replay(_setup(num_nodes=1), configs, programs=progs)
    new_tokens = {(p.program_id, s.session_id, i): t.input_tokens
                  for p in progs for s in p.sessions for i, t in enumerate(s.turns)}  # fmt: skip
    checked = 0
    for res, resent in zip(results, (True, False), strict=True):
        by = {(t.program_id, t.session_key.partition("/")[2], t.turn_index): t for t in res.turns}
        for (pid, sid, i), t in by.items():
            prev = by.get((pid, sid, i - 1))
            if prev is None:
                continue
            grown = t.prompt_tokens - prev.prompt_tokens
            assert grown == new_tokens[(pid, sid, i)] + (prev.output_tokens if resent else 0)
            checked += 1
    assert checked > 10
    on, off = (sum(t.prompt_tokens for t in r.turns) for r in results)
    assert off < on
