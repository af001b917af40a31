"""``hintflow replay --backend vllm``: a replay workload against real vLLM nodes, one server per policy.

Why its own path: the modeled replay runs programs on virtual time over our schedulers; here the same
programs (loaded with replay's readers and generators, ``read_workload``) become the vLLM agent
benchmark's programs (``replay._vllm_workload.agent_programs``: token ids per turn,
outputs capped, pauses as in the trace, sessions with their ``after`` / ``join``) and run in real time
against real vLLM OpenAI servers that ``replay._vllm_bench.run_mode`` starts, one per policy, each with the same
model and the same KV pool. The policies are the benchmark's modes: ``vanilla`` (stock vLLM),
``hintflow-infer`` (our scheduler, hints inferred from ``program_id`` / ``tool`` / ``is_last_turn``) and
``hintflow-orchestrator`` (our scheduler, the ``hintflow`` policy pushing hints over gRPC), and the
baselines ``continuum``, ``kvflow``, ``thunderagent`` pushing theirs to the same node; each also as
``MODE+host``, with hintflow's host KV tier (``_host_connector``) of ``--host-capacity-tokens`` (default:
every program's longest context, host memory for all of them).

The pool defaults to a third of the live programs' contexts (``pool_blocks_for``, as the benchmark), never
less than one longest request. The benchmark is imported inside the functions, so the ``hintflow``
command line starts without it.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

__all__ = [
    "VLLM_WORKLOAD_DEFAULTS",
    "VllmVariant",
    "bracketed_ratios",
    "check_backend_options",
    "median_rounds",
    "paired_ratios",
    "parse_modes",
    "parse_vllm_variant",
    "run_vllm_replay",
    "sitting_order",
    "stock_of",
    "vllm_replay",
    "vllm_table",
]

VLLM_WORKLOAD_DEFAULTS: dict[str, dict[str, float]] = {
    # swe-agent: the benchmark's `--workload swe-agent` defaults (contexts up to ~4k tokens on the tiny model)
    "swe-agent": {"num_programs": 40, "rate": 1.0, "scale": 0.1},
    "multi-agent": {"num_programs": 40, "rate": 0.5, "scale": 0.2},
    # human-in-loop pauses are minutes of real time: a run lasts as long as its programs do
    "human-in-loop": {"num_programs": 40, "rate": 0.5, "scale": 0.2},
}
"""Per generator, with ``--backend vllm``: programs, arrival rate and token scale when not given (files:
all programs, the trace's arrivals, scale 1)."""

MODELED_ONLY = {"cost_model": "--cost-model", "host_memory": "--host-memory",
                "block_size": "--block-size", "ttft_deadline_s": "--ttft-deadline", "plots_dir": "--plots",
                "csv_out": "--csv"}
VLLM_ONLY = {"vllm_python": "--vllm-python", "vllm_model": "--model", "state_dir": "--state-dir",
             "rounds": "--rounds", "bracket": "--bracket"}
PAIRED = ("jct_mean_s", "jct_p90_s", "ttft_p50_s", "ttft_p99_s")
"""Figures given per round as ratios to the same round's stock run (``--rounds``), or to the stock runs
either side of the run (``--bracket``)."""


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def check_backend_options(ctx: click.Context, backend: str) -> None:
    """A usage error for options the chosen backend does not use (they would be silently ignored)."""
    p = ctx.params
    if backend == "vllm":
        wrong = [flag for name, flag in MODELED_ONLY.items() if _given(ctx, name)]
        if p.get("executor") == "torch":
            wrong.insert(0, "--executor torch")
        if _given(ctx, "num_nodes") and p.get("num_nodes") != 1:
            wrong.append("--nodes (one vLLM node per policy)")
        if wrong:
            raise click.UsageError(f"--backend vllm runs real vLLM servers; it does not take {', '.join(wrong)}")
    else:
        wrong = [flag for name, flag in VLLM_ONLY.items() if _given(ctx, name)]
        if wrong:
            verb = "applies" if len(wrong) == 1 else "apply"
            raise click.UsageError(f"{', '.join(wrong)} {verb} only with --backend vllm")


def parse_modes(spec: str, variants: Sequence[VllmVariant] = ()) -> list[str]:
    """``--policy`` for the vLLM backend: comma-separated benchmark modes (each optionally ``+host``) and
    ``--variant`` names, or ``all`` (every mode without the host tier)."""
    from replay._vllm_bench import MODES

    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return list(MODES)
    known = {v.name for v in variants}
    unknown = [n for n in names if n.removesuffix("+host") not in MODES and n not in known]
    if unknown or not names:
        from replay._policies import REPLAY_CONFIGS

        modeled = [n for n in unknown if n in REPLAY_CONFIGS]
        note = f"; {', '.join(modeled)}: --backend modeled" if modeled else ""
        word = "policies" if len(unknown) > 1 else "policy"
        also = f", or a --variant ({', '.join(sorted(known))})" if known else ""
        raise ValueError(f"unknown {word} {', '.join(map(repr, unknown)) or repr(spec)} for --backend vllm; known: "
                         f"{', '.join(MODES)}, each optionally with +host (or all){also}{note}")
    return list(dict.fromkeys(names))


@dataclass(frozen=True, slots=True)
class VllmVariant:
    """``--variant NAME=MODE:KEY=VALUE,...`` with ``--backend vllm``: MODE's server and client with the pushed
    policy's options (``policy.KEY``, as a worker's ``--policy 'hintflow:KEY=VALUE'``) or the node's
    settings (``env.HINTFLOW_*``) changed, run and reported as NAME beside the others in the same sitting,
    so two settings of one mode are compared round by round rather than across sittings."""

    name: str
    mode: str
    policy_options: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def parse_vllm_variant(text: str, earlier: Sequence[VllmVariant] = ()) -> VllmVariant:
    """One ``--variant`` for the vLLM backend; ``ValueError`` naming what is wrong.  A variant of a ``+host``
    mode must be named ``...+host`` (so it is compared with ``vanilla+host``, as its mode is), and the
    other way round; ``policy.*`` keys need a mode whose policy pushes hints; ``env.*`` keys a hintflow
    node (stock vLLM reads none)."""
    from engine_adapter.vllm_backend import NODE_SETTINGS
    from orchestrator import POLICY_OPTIONS, Option, parse_options
    from replay._policies import _NAME
    from replay._vllm_bench import MODES, PUSHED_POLICY

    where = f"--variant {text!r}"
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: expected NAME=MODE:KEY=VALUE,... with NAME of letters, digits, '_.+-' (at most 40)")
    prior = {v.name: v for v in earlier}
    if name.removesuffix("+host") in MODES or name in prior:
        raise ValueError(f"{where}: the name {name!r} is already taken")
    base_name, _, opts = rest.partition(":")
    base_name = base_name.strip()
    if base_name in prior:
        base = prior[base_name]
    elif base_name.removesuffix("+host") in MODES:
        base = VllmVariant(base_name, base_name)
    else:
        raise ValueError(f"{where}: unknown mode {base_name!r}; known: {', '.join(MODES)}, each optionally "
                         "with +host, or an earlier --variant")
    if name.endswith("+host") != base.mode.endswith("+host"):
        want = "ends" if base.mode.endswith("+host") else "does not end"
        raise ValueError(f"{where}: a variant of {base.mode!r} is compared with the same stock run, so its "
                         f"name {want} with '+host'")
    options = {f"policy.{k}": o for k, o in POLICY_OPTIONS.items()}
    options.update((f"env.{k}", Option(str, "a node setting")) for k in NODE_SETTINGS)
    given = parse_options(opts, options, where)
    if not given:
        raise ValueError(f"{where}: no options given (KEY=VALUE after {base_name}:)")
    plain = base.mode.removesuffix("+host")
    for key, _ in given:
        if key.startswith("policy.") and plain not in PUSHED_POLICY:
            raise ValueError(f"{where}: {key} needs a mode whose policy pushes hints "
                             f"({', '.join(PUSHED_POLICY)}); {plain!r} pushes none")
        if key.startswith("env.") and plain == "vanilla":
            raise ValueError(f"{where}: {key}: stock vLLM reads no HINTFLOW_* setting")
    policy = dict(base.policy_options) | {k.removeprefix("policy."): v for k, v in given if k.startswith("policy.")}
    env = dict(base.env) | {k.removeprefix("env."): str(v) for k, v in given if k.startswith("env.")}
    return VllmVariant(name, base.mode, tuple(policy.items()), tuple(env.items()))


def _model_max_len(model: Path) -> int | None:
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, int) else None


def run_vllm_replay(
    *, workload: str, modes: list[str], num_programs: int | None = None, rate: float | None = None,
    scale: float | None = None, seed: int = 0, kv_capacity_tokens: int | None = None,
    vllm_python: str | None = None, model: str | Path | None = None, state_dir: str | Path | None = None,
    pin_budget: float | None = None, host_capacity_tokens: int | None = None, progress: Callable[[str, int], Callable[[int], None]] | None = None,
    log: Callable[[str], None] = lambda _m: None, rounds: int = 1, variants: Sequence[VllmVariant] = (),
    bracket: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Load the workload, convert it, run each mode on its own server; the report (``policies``: one
    summary per mode, ``programs``: per program and turn, ``verdict`` against vanilla, ``config``).

    ``rounds`` > 1: every mode runs that many times, in turn, the order reversed every other round (so a
    machine that drifts over the sitting weighs on every mode alike); ``policies`` then holds each figure's
    median over the rounds, ``rounds`` each round's summaries, ``ratios`` each mode's per-round ratios to
    that round's ``vanilla`` (:func:`paired_ratios`), and ``programs`` the first round's turns.
    ``bracket``: stock runs before and after every other mode in each round (:func:`sitting_order`); each
    mode's ``ratios`` are then to the two stock runs either side of it (:func:`bracketed_ratios`), even in
    one round, ``sequence`` lists each round's runs in the order they ran, and a stock row's figures are the
    median of all its runs.
    ``variants``: those named in ``modes`` run as their mode with their policy options and node settings.

    ``ValueError`` for a workload or sizes that cannot run, ``RuntimeError`` / ``TimeoutError`` when a
    server does not come up (with its log's tail).
    """
    from engine_adapter.vllm_backend import find_vllm_python, node_defaults
    from replay._readers import read_workload
    from replay._vllm_bench import (
        ensure_model,
        max_model_len_for,
        run_mode,
        verdict,
    )
    from replay._vllm_workload import BLOCK, MAX_OUTPUT, agent_programs, pool_blocks_for

    # before anything starts: a bracketed sitting without its stock mode would run unbracketed
    if bracket and (alone := [m for m in modes if m not in ("vanilla", "vanilla+host") and stock_of(m, modes) is None]):
        raise ValueError(f"--bracket runs stock vLLM either side of every other mode: add vanilla to the "
                         f"policies ({', '.join(alone)} would have no stock run to compare with)")
    kind = workload.partition(":")[0]
    d = VLLM_WORKLOAD_DEFAULTS.get(kind, {})
    num_programs = num_programs if num_programs is not None else _int_or_none(d.get("num_programs"))
    rate = rate if rate is not None else d.get("rate")
    scale = scale if scale is not None else d.get("scale", 1.0)
    programs = read_workload(workload, seed=seed, rate=rate, scale=scale, limit=num_programs)
    if not programs:
        raise ValueError(f"workload {workload!r} has no programs")
    agents = agent_programs(programs, seed=seed)
    max_len = max_model_len_for(agents)
    wanted, live = pool_blocks_for(agents, fraction=1 / 3)
    if kv_capacity_tokens is not None:
        wanted = math.ceil(kv_capacity_tokens / BLOCK)
    floor = max_len // BLOCK + 1  # the pool must hold one longest request (and vLLM's null block)
    blocks = max(wanted, floor)
    host_tokens = host_capacity_tokens or sum(p.max_context for p in agents)
    if host_capacity_tokens is not None and host_capacity_tokens < BLOCK:
        raise ValueError(f"--host-capacity-tokens {host_capacity_tokens}: less than one {BLOCK}-token block")

    python = vllm_python or find_vllm_python()
    if python is None:
        raise ValueError("no Python with vLLM: run scripts/install.sh vllm (creates .venv-vllm), set "
                         "HINTFLOW_VLLM_PYTHON or pass --vllm-python")
    state = Path(state_dir or Path(tempfile.gettempdir()) / "hintflow-replay-vllm").resolve()
    state.mkdir(parents=True, exist_ok=True)
    if model is None:
        model_dir = state / "tiny-model"
        log(f"building the tiny model in {model_dir}" if not (model_dir / "config.json").exists() else "")
        ensure_model(python, model_dir)
    else:
        model_dir = Path(model).resolve()
        if not (model_dir / "config.json").exists():
            raise ValueError(f"--model {model}: no config.json there (build one with `hintflow make-tiny-model DIR`)")
    limit = _model_max_len(model_dir)
    if limit is not None and max_len > limit:
        raise ValueError(f"the longest request needs {max_len:,} tokens (max-model-len) but the model takes "
                         f"{limit:,}: lower --scale")  # fmt: skip

    report: dict[str, Any] = {"backend": "vllm", "policies": {}, "programs": {}, "verdict": {}}
    device, host = node_defaults(False), node_defaults(True)
    report["config"] = {
        "workload": workload, "num_programs": len(programs), "rate": rate, "scale": scale, "seed": seed,
        "multi_session_programs": sum(1 for p in agents if len(p.all_sessions) > 1),
        "num_turns": sum(p.num_turns for p in agents), "max_output_tokens": MAX_OUTPUT,
        "block_size": BLOCK, "num_gpu_blocks": blocks, "kv_capacity_tokens": blocks * BLOCK,
        "kv_capacity_tokens_wanted": wanted * BLOCK if kv_capacity_tokens is None else kv_capacity_tokens,
        "kv_capacity_source": "--kv-capacity-tokens" if kv_capacity_tokens is not None
        else "a third of the live programs' contexts", "expected_live_programs": live,
        "max_model_len": max_len, "pin_budget": pin_budget,
        # hintflow's own nodes' defaults by memory point (the mirror reads them): admission's longest hold and
        # the FCFS bound's slack (None: off), without a host tier and with one ("_host")
        "admit_max_wait_s": device.admit_max_wait_s, "admit_max_wait_s_host": host.admit_max_wait_s,
        "fcfs_slack": _finite(device.fcfs_slack), "fcfs_slack_host": _finite(host.fcfs_slack),
        "warm_first": True,  # hintflow's own nodes ran the warm-first rule (HINTFLOW_WARM_FIRST; the mirror reads it)
        "hold_queued": device.hold_queued, "hold_queued_host": host.hold_queued,  # (HINTFLOW_HOLD_QUEUED)
        "host_capacity_tokens": host_tokens if any(m.endswith("+host") for m in modes) else None, "model": str(model_dir), "vllm_python": python,
        "state_dir": str(state), "policies": modes, "rounds": rounds, "bracket": bracket,
    }  # fmt: skip
    by_name = {v.name: v for v in variants if v.name in modes}
    if by_name:
        report["config"]["variants"] = {v.name: {"mode": v.mode, "policy_options": dict(v.policy_options),
                                                 "env": dict(v.env)} for v in by_name.values()}  # fmt: skip
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    t0 = time.perf_counter()
    runs: list[dict[str, dict[str, Any]]] = []
    sequence: list[list[tuple[str, dict[str, Any]]]] = []
    for r in range(rounds):
        sequence.append([])
        for mode in sitting_order(modes, r, bracket=bracket):
            which = f" (round {r + 1} of {rounds})" if rounds > 1 else ""
            log(f"{mode}{which}: starting a vLLM server ({blocks} blocks of {BLOCK} tokens), {len(agents)} programs")
            v = by_name.get(mode, VllmVariant(mode, mode))
            for attempt in range(1 + PORT_RETRIES):
                cb = progress(mode, len(agents)) if progress is not None else None
                try:
                    summary = run_mode(
                        v.mode, agents, model=model_dir, python=python, state=state, num_blocks=blocks,
                        max_model_len=max_len, pin_budget=pin_budget, extra_args=[], progress=cb,
                        host_capacity_tokens=host_tokens, label=mode, policy_options=v.policy_options,
                        hint_env=dict(v.env),
                    )  # fmt: skip
                    break
                except RuntimeError as e:
                    if not _lost_port(e) or attempt == PORT_RETRIES:
                        raise
                    log(f"{mode}: a port chosen for its server was taken before it bound; starting it again")
            sequence[r].append((mode, summary))
            if mode not in report["programs"]:  # each mode's first run
                report["programs"][mode] = json.loads((state / f"{mode}.programs.json").read_text())
        # a mode's row of the round: its run, or the median of a stock mode's bracketing runs
        runs.append(median_rounds([{m: row} for m, row in sequence[r]], modes, partial=True))
    report["policies"] = median_rounds(runs, modes)
    if rounds > 1:
        report["rounds"] = runs
        report["ratios"] = paired_ratios(runs)
    if bracket:
        report["sequence"] = [[{"mode": m, **row} for m, row in seq] for seq in sequence]
        report["ratios"] = bracketed_ratios(sequence)
    report["verdict"] = verdict(report["policies"])
    report["config"]["wall_s"] = time.perf_counter() - t0
    return report


PORT_RETRIES = 2
"""Times a server whose port was taken between choosing it and binding it is started again (on a busy
machine the clients' own connections take ephemeral ports from the same range; one lost mode must not
lose a sitting of several rounds)."""


def _finite(x: float) -> float | None:
    """A setting as the report writes it: None for inf (off), as JSON has no infinity."""
    return x if math.isfinite(x) else None


def _lost_port(e: BaseException) -> bool:
    text = str(e)
    return "Address already in use" in text or "Failed to bind to address" in text


def sitting_order(modes: Sequence[str], round_index: int, *, bracket: bool = False) -> list[str]:
    """The order one round runs its modes in: as given, reversed every other round (so a machine that
    drifts over the sitting weighs on every mode alike). ``bracket``: each other mode between two runs of
    its stock mode (:func:`stock_of`), a stock run shared by neighbours (``S A S B S``): an A-B-A design,
    in which a drift that is smooth over two runs cancels from the mode's ratio wherever in the sitting it
    peaks, at the cost of one more stock run per mode."""
    order = list(modes) if round_index % 2 == 0 else list(modes)[::-1]
    if not bracket:
        return order
    out: list[str] = []
    for mode in order:
        ref = stock_of(mode, modes)
        if ref is None:
            continue  # stock runs only around the modes it is the reference of
        if not out or out[-1] != ref:
            out.append(ref)
        out += [mode, ref]
    # a stock mode no other mode is compared with still runs once
    return out + [m for m in order if stock_of(m, modes) is None and m not in out]


def median_rounds(
    runs: list[dict[str, dict[str, Any]]], modes: list[str], *, partial: bool = False
) -> dict[str, dict[str, Any]]:
    """Each mode's summary over the rounds: the median of every number (the first round's other fields),
    failed programs summed, errors of every round. ``partial``: a run need not hold every mode (the runs of
    one bracketed round, one mode each)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        rows = [run[mode] for run in runs if mode in run or not partial]
        merged = dict(rows[0])
        for key in rows[0]:
            values = [row[key] for row in rows]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                med = statistics.median(values)
                ints = all(isinstance(v, int) for v in values) and float(med).is_integer()
                merged[key] = int(med) if ints else med  # (counts stay counts: "555", not "555.0")
        merged["failed"] = sum(row["failed"] for row in rows)
        merged["errors"] = [e for row in rows for e in row.get("errors", [])]
        if isinstance(rows[0].get("programs"), int):
            merged["programs"] = rows[0]["programs"]  # (the same programs every round)
        out[mode] = merged
    return out


def stock_of(mode: str, modes: Collection[str]) -> str | None:
    """The stock run a mode is compared with: ``vanilla+host`` for a ``+host`` mode when it ran (the same
    host tier under vLLM's own scheduler), else ``vanilla``; None for those two or when neither ran."""
    if mode in ("vanilla", "vanilla+host"):
        return None
    if mode.endswith("+host") and "vanilla+host" in modes:
        return "vanilla+host"
    return "vanilla" if "vanilla" in modes else None


def paired_ratios(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per mode with a stock run to compare with (:func:`stock_of`), per figure of :data:`PAIRED`: its
    ratio to that stock run of the same round, each round's and their median, min and max."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in runs[0]:
        base = stock_of(mode, runs[0])
        if base is None:
            continue
        out[mode] = {}
        for key in PAIRED:
            each = [run[mode][key] / run[base][key] for run in runs if run[base][key]]
            if each:
                out[mode][key] = {"median": statistics.median(each), "min": min(each), "max": max(each),
                                  "rounds": each}  # fmt: skip
    return out


def bracketed_ratios(sequence: list[list[tuple[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per mode with a stock mode (:func:`stock_of`), per figure of :data:`PAIRED`: each run's ratio to the
    mean of the nearest runs of its stock mode before and after it in the same round (one side where the
    other has none), and their median, min and max over its runs."""
    modes = {m for seq in sequence for m, _ in seq}
    each: dict[str, dict[str, list[float]]] = {}
    for seq in sequence:
        for i, (mode, row) in enumerate(seq):
            base = stock_of(mode, modes)
            if base is None:
                continue
            before = next((r for m, r in reversed(seq[:i]) if m == base), None)
            after = next((r for m, r in seq[i + 1:] if m == base), None)
            refs = [r for r in (before, after) if r is not None]
            for key in PAIRED:
                ref = sum(r[key] for r in refs) / len(refs) if refs else 0.0
                if ref:
                    each.setdefault(mode, {}).setdefault(key, []).append(row[key] / ref)
    return {mode: {key: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}
                   for key, xs in figures.items()} for mode, figures in each.items()}  # fmt: skip


def _int_or_none(x: float | None) -> int | None:
    return None if x is None else int(x)


_COLUMNS = (("JCT mean", "jct_mean_s", "s"), ("JCT p90", "jct_p90_s", "s"), ("TTFT p50", "ttft_p50_s", "ms"),
            ("TTFT p99", "ttft_p99_s", "ms"), ("across-turn hits", "across_turn_hit_rate", "%"),
            ("prompt tokens", "prompt_tokens", "n"), ("cached", "cached_tokens", "n"))


def vllm_table(report: dict[str, Any]) -> str:
    """A markdown table like replay's; times carry (× vanilla) where vanilla ran."""
    pols = report["policies"]
    paired = report.get("ratios") or {}
    lines = ["| policy | programs (failed) | turns | " + " | ".join(c[0] for c in _COLUMNS) + " |",
             "|---" * (len(_COLUMNS) + 3) + "|"]
    for name, m in pols.items():
        stock = stock_of(name, pols)
        base = pols[stock] if stock is not None else None
        cells = [f"{m['programs']} ({m['failed']})", str(m["turns"])]
        for _, key, kind in _COLUMNS:
            v = m[key]
            if kind == "%":
                cells.append(f"{v:.1%}")
            elif kind == "n":
                cells.append(f"{v:,}")
            else:
                ratio = f" ({v / base[key]:.2f}×)" if base is not None and base[key] else ""
                if key in paired.get(name, {}):  # per round: median (min-max) of the paired ratios
                    r = paired[name][key]
                    ratio = f" ({r['median']:.2f}×, {r['min']:.2f}-{r['max']:.2f})"
                cells.append(f"{v:.{3 if kind == 'ms' else 2}f} s{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    rounds = len(report.get("rounds") or report.get("sequence") or ()) or 1
    compared = any(stock_of(name, pols) is not None for name in pols)
    if compared and report.get("sequence"):
        lines.append(f"\nmedians of {rounds} round(s), stock bracketing every other policy; in parentheses: × the "
                     "stock runs (vanilla, or vanilla+host for a +host policy) either side of each run, median "
                     "(lowest-highest)")
    elif compared and rounds > 1:
        lines.append(f"\nmedians of {rounds} rounds; in parentheses: × stock (vanilla, or vanilla+host for a "
                     "+host policy) of the same round, median (lowest-highest)")
    elif compared:
        lines.append("\nratios in parentheses: × stock (vanilla, or vanilla+host for a +host policy)")
    for name, m in pols.items():
        if m["failed"]:
            lines.append(f"{name}: {m['failed']} program(s) failed: {'; '.join(m['errors'])}")
    return "\n".join(lines)


def vllm_replay(ctx: click.Context, progress: Callable[[str, int], Callable[[int], None]] | None) -> None:
    """The command's vLLM half: options from ``ctx``, the run, the table, the JSON."""
    p = ctx.params
    variants: list[VllmVariant] = []
    try:
        for text in p["variants"]:
            variants.append(parse_vllm_variant(text, variants))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--variant") from None
    try:
        modes = parse_modes(p["policies"], variants)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--policy") from None
    if unused := [v.name for v in variants if v.name not in modes]:
        click.echo(f"note: --variant {', '.join(unused)} not in --policy, so not run", err=True)

    def log(msg: str) -> None:
        if msg and p["progress"]:
            click.echo(f"[replay vllm] {msg}", err=True)

    try:
        report = run_vllm_replay(
            workload=p["workload"], modes=modes, num_programs=p["num_programs"], rate=p["rate"], scale=p["scale"],
            seed=p["seed"], kv_capacity_tokens=p["kv_capacity_tokens"], vllm_python=p["vllm_python"],
            model=p["vllm_model"], state_dir=p["state_dir"], progress=progress, log=log,
            host_capacity_tokens=p["host_capacity_tokens"], rounds=p["rounds"], variants=variants,
            bracket=p["bracket"],
        )  # fmt: skip
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    c = report["config"]
    raised = (f" (raised from {c['kv_capacity_tokens_wanted']:,}: one longest request must fit)"
              if c["kv_capacity_tokens"] > c["kv_capacity_tokens_wanted"] else "")  # fmt: skip
    several = f" ({c['multi_session_programs']} of several sessions)" if c["multi_session_programs"] else ""
    host = f"host tier of +host policies {c['host_capacity_tokens']:,} tokens, " if c["host_capacity_tokens"] else ""
    click.echo(f"{c['workload']}: {c['num_programs']} programs{several}, {c['num_turns']} turns, one real vLLM "
               f"node per policy ({Path(c['model']).name}), token scale {c['scale']:g}, outputs <= "
               f"{c['max_output_tokens']} tokens, KV pool {c['num_gpu_blocks']} blocks of {c['block_size']} = "
               f"{c['kv_capacity_tokens']:,} tokens{raised}, {host}max-model-len {c['max_model_len']:,}, "
               f"{c['rounds']} round(s){', stock bracketing each' if c['bracket'] else ''}, "
               f"{c['wall_s']:.1f} s wall")  # fmt: skip
    click.echo(vllm_table(report))
    if p["json_out"]:
        Path(p["json_out"]).write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"JSON: {p['json_out']}")
    failed = sum(m["failed"] for m in report["policies"].values())
    if failed:
        click.echo(f"{failed} program run(s) failed; logs in {c['state_dir']}", err=True)
        ctx.exit(1)
