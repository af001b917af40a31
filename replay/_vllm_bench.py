"""Agent workload against one real vLLM node: stock vLLM vs hintflow (inferred hints, orchestrator hints).

Why: issue 5's Done-when is measured on vLLM itself. Each mode starts its own server on the same model
and the same KV pool (``--num-gpu-blocks-override``, sized to ``--pool-fraction`` of the live programs'
contexts), replays the same programs (full context resent each turn, streamed), and reports job
completion time (arrival to last token of the last turn), time to first token, and the across-turn hit
rate (cached tokens over the prompt tokens an earlier turn of the program had already sent).

Modes: ``vanilla`` (no ``--scheduler-cls``, FCFS), ``hintflow-infer`` (our scheduler; the client adds only
``program_id``, ``tool``, ``is_last_turn``), ``hintflow-infer-pid`` (the same scheduler; the client adds
``program_id`` alone, issue 5's plain OpenAI client), ``hintflow-orchestrator`` (our scheduler; the ``hintflow``
policy fed with the client's events pushes hints over gRPC; the client adds only ``program_id``), and
``continuum``, ``kvflow``, ``thunderagent`` (the same node and hint path, that baseline policy pushing; KVFlow
without program-level order; ThunderAgent with its pause/restore controller, ``orchestrator.ThunderAgent``,
holding paused sessions' requests in the client). Each
mode with ``+host`` (``vanilla+host``, ...) adds hintflow's host KV tier (``_host_connector``) of
``--host-capacity-tokens`` (default: every program's longest context, i.e. host memory for all of them).

    hintflow engine vllm-bench --out report.json   # see --help
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_adapter.vllm_backend import (
    AGING_S,
    HOST_RELOAD_S_PER_TOKEN,
    REPO,
    build_vllm_command,
    start_vllm,
    stop_vllm,
    wait_healthy,
)
from orchestrator import THUNDER_PERIOD_S, PolicySpec
from replay._vllm_agents import HintPusher, ProgramResult, run_program
from replay._vllm_backend import stock_of
from replay._vllm_readings import NodeReadings
from replay._vllm_workload import (
    BLOCK,
    AgentProgram,
    builtin_programs,
    export_trace,
    pool_blocks_for,
    swe_agent_programs,
)

__all__ = ["MODES", "ensure_model", "main", "max_model_len_for", "run_mode", "summarize", "verdict"]

MODES = ("vanilla", "hintflow-infer", "hintflow-infer-pid", "hintflow-orchestrator", "continuum", "kvflow",
         "thunderagent")
PUSHED_POLICY = {"hintflow-orchestrator": "hintflow", "continuum": "continuum", "kvflow": "kvflow",
                 "thunderagent": "thunderagent"}
"""Modes in which an orchestrator policy pushes hints over gRPC to hintflow's vLLM node (the same hint path
for ours and the baselines; the node infers nothing for a session that gets hints)."""
_BASELINE_NODE = {"HINTFLOW_INFER_HINTS": "0", "HINTFLOW_ADMIT_MAX_WAIT_S": str(AGING_S), "HINTFLOW_WARM_FIRST": "0",
                  "HINTFLOW_FCFS_SLACK": "inf", "HINTFLOW_HOLD_QUEUED": "0"}
MODE_ENV = {
    "continuum": _BASELINE_NODE,
    "kvflow": {**_BASELINE_NODE, "HINTFLOW_PRIORITY_AGING_S": "0", "HINTFLOW_ADMIT_MAX_WAIT_S": "0"},
    "thunderagent": _BASELINE_NODE,
}
"""The node's settings a mode implies. A baseline's node infers no hints of its own: only the policy's
pushed hints act (with inference on, the node pinned a session at its first turn's end until the pusher's
first hint for it, hintflow's mechanism in a baseline's run: kvflow was 1.08x / 1.05x stock's mean / p90
JCT with it and 1.01x / 1.01x without, one bracketed sitting, docs/benchmarks.md). KVFlow orders requests
FCFS (no program-level priority; with no head start for older programs the node's priority order is
arrival order). The node's program admission holds a baseline's new programs no longer than its aging
bound (as every mode was measured before hintflow's own hold became ``ADMIT_MAX_WAIT_S``): a hold that
binds is hintflow's mechanism too; so are the FCFS bound (``HINTFLOW_FCFS_SLACK``) and the queue hold
(``HINTFLOW_HOLD_QUEUED``), off for them."""

_IPC_PATH_MAX = 107
"""A Unix socket's path at most (``sockaddr_un.sun_path``): a deeper state dir gets its sockets in a short
temporary folder instead (vLLM fails to start with "ipc path ... is longer than 107 characters")."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q * len(ys)) - 1))]


def summarize(results: list[ProgramResult], wall_s: float) -> dict[str, Any]:
    """The report's figures for one mode."""
    ok = [r for r in results if not r.error]
    jct = [r.jct_s for r in ok]
    turns = [t for r in ok for t in r.turns]
    ttft = [t.ttft_s for t in turns]
    already = sum(t.already_sent_tokens for t in turns)
    hits = sum(min(t.cached_tokens, t.already_sent_tokens) for t in turns)
    return {
        "programs": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "turns": len(turns),
        "jct_mean_s": sum(jct) / len(jct) if jct else math.nan,
        "jct_p50_s": _q(jct, 0.5),
        "jct_p90_s": _q(jct, 0.9),
        "jct_p99_s": _q(jct, 0.99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else math.nan,
        "ttft_p50_s": _q(ttft, 0.5),
        "ttft_p90_s": _q(ttft, 0.9),
        "ttft_p99_s": _q(ttft, 0.99),
        "across_turn_hit_rate": hits / already if already else math.nan,
        "across_turn_tokens": already,
        "across_turn_hit_tokens": hits,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "wall_s": wall_s,
    }


def run_mode(
    mode: str, programs: list[AgentProgram], *, model: Path, python: str, state: Path, num_blocks: int,
    max_model_len: int, pin_budget: float | None, extra_args: list[str], aging_s: float | None = None,
    hint_env: dict[str, str] | None = None, progress: Callable[[int], None] | None = None,
    host_capacity_tokens: int = 0, label: str | None = None, policy_options: tuple[tuple[str, Any], ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """Start this mode's server, replay the programs, stop it; the mode's summary.

    ``progress(1)`` is called as each program finishes (from the client threads). A mode named
    ``BASE+host`` runs ``BASE`` with hintflow's host KV tier of ``host_capacity_tokens`` tokens.
    ``label``: the run's name for its log and results files (a ``--variant``'s; default the mode);
    ``policy_options``: the pushed policy's options (``orchestrator.POLICY_OPTIONS``)."""
    base_mode, plus, tier = mode.partition("+")
    if base_mode not in MODES or (plus and tier != "host"):
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}, each optionally with '+host'")
    if plus and host_capacity_tokens < 1:
        raise ValueError(f"mode {mode!r} needs a positive host_capacity_tokens")
    if policy_options and base_mode not in PUSHED_POLICY:
        raise ValueError(f"mode {mode!r} pushes no policy to take options {dict(policy_options)}")
    label = label or mode
    port, hint_port = _free_port(), _free_port()
    hintflow = base_mode != "vanilla"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--num-gpu-blocks-override", str(num_blocks), *extra_args]  # fmt: skip
    argv, env = build_vllm_command(
        model, port=port, hint_port=hint_port if hintflow else None, pin_budget=pin_budget,
        state_dir=state / label, python=python, extra_args=args, hintflow=hintflow,
        host_capacity_tokens=host_capacity_tokens if plus else None,
    )  # fmt: skip
    if hintflow and aging_s is not None:
        env["HINTFLOW_PRIORITY_AGING_S"] = str(aging_s)
    if hintflow:
        env.update(MODE_ENV.get(base_mode, {}))
        env.update(hint_env or {})
    short_rpc = None
    if len(env["VLLM_RPC_BASE_PATH"]) + 1 + 36 > _IPC_PATH_MAX:  # vLLM's sockets: BASE/uuid4
        short_rpc = tempfile.mkdtemp(prefix="hintflow-rpc-")
        env["VLLM_RPC_BASE_PATH"] = short_rpc
    log = state / f"{label}.log"
    proc = start_vllm(argv, env, log, cwd=state)
    base = f"http://127.0.0.1:{port}"
    pusher = None
    readings = None
    try:
        wait_healthy(proc, base, log)
        warm = AgentProgram("warmup", 0.0, programs[0].all_sessions[0].turns[:1])
        run_program(base, str(model), warm, time.monotonic(), "plain")
        if base_mode in PUSHED_POLICY:
            pusher = HintPusher(f"127.0.0.1:{hint_port}", PolicySpec(PUSHED_POLICY[base_mode], policy_options),
                                host_s_per_token=HOST_RELOAD_S_PER_TOKEN if plus else None,
                                pool_tokens=float(num_blocks * BLOCK),
                                thunder_period_s=THUNDER_PERIOD_S if base_mode == "thunderagent" else None)
        if hintflow:  # the node's own readings of its load, while the programs run
            readings = NodeReadings(f"127.0.0.1:{hint_port}")
        client_mode = "infer" if base_mode == "hintflow-infer" else "plain"
        t0 = time.monotonic() + 0.5
        if pusher is not None:
            pusher.t0 = t0  # events and ticks on the programs' clock
        with ThreadPoolExecutor(max_workers=len(programs)) as pool:
            futs = [pool.submit(run_program, base, str(model), p, t0, client_mode, pusher) for p in programs]
            if progress is not None:
                for f in futs:
                    f.add_done_callback(lambda _f: progress(1))
            results = [f.result() for f in futs]
        out = summarize(results, time.monotonic() - t0)
        out["preemptions"] = vllm_counter(base, "vllm:num_preemptions_total")
        if readings is not None:
            out.update(readings.stop())
            readings = None
            lost = node_lost_shares(log.read_text(errors="replace")) if log.exists() else None
            if lost is not None:
                out["node_lost_by"] = lost
        dump = [{"program": r.program_id, "arrival_s": r.arrival_s, "jct_s": r.jct_s, "error": r.error,
                 "turns": [vars(t) for t in r.turns]} for r in results]  # fmt: skip
        (state / f"{label}.programs.json").write_text(json.dumps(dump))
        if pusher is not None:
            out["hints_sent"] = dict(pusher.sent)
            out["hint_results"] = dict(pusher.codes)
        return out
    finally:
        if readings is not None:
            readings.stop()
        if pusher is not None:
            pusher.close()
        stop_vllm(proc)
        if short_rpc is not None:
            shutil.rmtree(short_rpc, ignore_errors=True)


def node_lost_shares(log_text: str) -> dict[str, float] | None:
    """The shares of a hintflow node's recomputed history by cause, from the last ``lost=`` of its 10 s log
    line (``RequestAccounting.lost_shares``; at most 10 s before the run's end); None when it logged none,
    ``{}`` when nothing was recomputed."""
    found = _LOST.findall(log_text)
    if not found:
        return None
    if found[-1] == "-":
        return {}
    return {cause: float(share) for cause, _, share in (item.partition(":") for item in found[-1].split(","))}


_LOST = re.compile(r"\blost=(\S+)")


def vllm_counter(base: str, name: str) -> float | None:
    """A counter from the server's own ``/metrics`` (every label summed; vLLM names it with ``_total``),
    None when it cannot be read: a figure stock vLLM and hintflow's node report alike."""
    values = vllm_counters(base, (name,))
    return values.get(name) if values is not None else None


def vllm_counters(base: str, names: Sequence[str]) -> dict[str, float] | None:
    """The named samples of the server's ``/metrics`` in one read, each summed over its labels (a
    histogram's ``_sum`` and ``_count`` are samples too); a name the server does not serve is left out.
    None when the server does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    wanted, out = set(names), dict[str, float]()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def ensure_model(python: str, model: Path) -> None:
    """Build the tiny model into ``model`` with the Python that has vLLM, unless a model is there."""
    if (model / "config.json").exists():
        return
    cmd = [python, "-c", "import sys; from engine_adapter.vllm_backend._tiny_model import make_tiny_model; "
           "make_tiny_model(sys.argv[1])", str(model)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)


def max_model_len_for(programs: list[AgentProgram]) -> int:
    """``--max-model-len``: the longest request (prompt and output) and some room, in whole blocks."""
    return BLOCK * math.ceil((max(p.max_context for p in programs) + 16) / BLOCK)


def verdict(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each mode against its stock run (:func:`stock_of`): which one, and the ratios of mean and p90 JCT
    and p99 TTFT to it (below 1 is better); modes with no stock run are left out."""
    out: dict[str, Any] = {}
    for name, m in modes.items():
        stock = stock_of(name, modes)
        if stock is None:
            continue
        v = modes[stock]
        out[name] = {
            "stock": stock,
            "jct_mean_ratio": m["jct_mean_s"] / v["jct_mean_s"],
            "jct_p90_ratio": m["jct_p90_s"] / v["jct_p90_s"],
            "ttft_p99_ratio": m["ttft_p99_s"] / v["ttft_p99_s"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="hintflow engine vllm-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny model)")
    ap.add_argument("--python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="Python with vLLM")
    ap.add_argument("--state-dir", type=Path, default=Path(tempfile.gettempdir()) / "hintflow-vllm-bench")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workload", choices=("builtin", "swe-agent"), default="builtin")
    ap.add_argument("--programs", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0, help="program arrivals per second (Poisson)")
    ap.add_argument("--scale", type=float, default=0.1, help="swe-agent token scale")
    ap.add_argument("--pause-scale", type=float, default=1.0, help="swe-agent pause scale")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-fraction", type=float, default=1 / 3)
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks (default: from --pool-fraction)")
    ap.add_argument("--pin-budget", type=float, default=None,
                    help="share of the pool pins may hold (default: the node's, 0.9 without a host tier, 0.5 with)")
    ap.add_argument("--host-capacity-tokens", type=int, default=0,
                    help="host KV tier of modes named MODE+host (default: every program's longest context)")
    ap.add_argument("--aging-s", type=float, default=None, help="HINTFLOW_PRIORITY_AGING_S for hintflow modes")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the hintflow modes' server (e.g. HINTFLOW_ADMIT_GUARD=0)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--export-trace", type=Path, default=None, metavar="FILE",
                    help="write the programs as a hintflow trace (for `hintflow replay -w hintflow:FILE`), "
                         "print the pool in tokens, and exit")
    ap.add_argument("extra", nargs="*", help="further vLLM flags (after --)")
    a = ap.parse_args(argv)
    if a.workload == "builtin":
        programs = builtin_programs(a.programs, rate=a.rate, seed=a.seed)
    else:
        programs = swe_agent_programs(a.programs, rate=a.rate, seed=a.seed, scale=a.scale, pause_scale=a.pause_scale)
    if a.export_trace is not None:
        blocks, _ = pool_blocks_for(programs, fraction=a.pool_fraction)
        floor = math.ceil((max(p.max_context for p in programs) + 16) / BLOCK) + 1
        a.export_trace.write_text(export_trace(programs))
        print(json.dumps({"trace": str(a.export_trace), "kv_capacity_tokens": max(a.num_blocks or blocks, floor) * BLOCK}))
        return {}
    hint_env = dict(kv.split("=", 1) for kv in a.env)
    state = a.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    model = (a.model or state / "tiny-model").resolve()
    ensure_model(a.python, model)
    max_len = max_model_len_for(programs)
    blocks, live = pool_blocks_for(programs, fraction=a.pool_fraction)
    blocks = a.num_blocks or blocks
    floor = max_len // BLOCK + 1
    host_tokens = a.host_capacity_tokens or sum(p.max_context for p in programs)
    report: dict[str, Any] = {
        "workload": {"kind": a.workload, "programs": a.programs, "rate": a.rate, "seed": a.seed,
                     "scale": a.scale if a.workload == "swe-agent" else None,
                     "expected_live_programs": live, "max_model_len": max_len},
        "num_gpu_blocks": max(blocks, floor), "pool_blocks_wanted": blocks, "pin_budget": a.pin_budget,
        "aging_s": a.aging_s, "hint_env": hint_env, "host_capacity_tokens": host_tokens,
        "modes": {},
    }  # fmt: skip
    for mode in a.modes.split(","):
        print(f"[agent-bench] {mode}: {len(programs)} programs, {report['num_gpu_blocks']} blocks", file=sys.stderr)
        report["modes"][mode] = run_mode(
            mode, programs, model=model, python=a.python, state=state, num_blocks=report["num_gpu_blocks"],
            max_model_len=max_len, pin_budget=a.pin_budget, extra_args=list(a.extra), aging_s=a.aging_s,
            hint_env=hint_env, host_capacity_tokens=host_tokens,
        )  # fmt: skip
        print(json.dumps({mode: report["modes"][mode]}), file=sys.stderr)
    report["verdict"] = verdict(report["modes"])
    text = json.dumps(report, indent=2)
    if a.out:
        a.out.write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
