"""``hintflow replay``: every policy side by side on one workload, on virtual time over modeled or torch nodes,
or (``--backend vllm``) in real time against real vLLM servers.

Thin by design: options become a ``ReplaySetup`` and a list of ``ReplayConfig``; ``run_replay`` does the
work; ``_report`` prints, writes and draws.  ``--backend vllm`` goes to ``_vllm_backend``, imported only
then.  Registered on the main group by ``hintflow/cli.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import click

from replay._policies import REPLAY_CONFIGS, ReplayConfig, parse_policy_list, parse_variant

__all__ = ["replay_command", "writable_parent"]


def _tqdm_progress(enabled: bool) -> Callable[[str, int], Callable[[int], None]] | None:
    if not enabled:
        return None
    from tqdm import tqdm

    bars: list[Any] = []

    def make(name: str, total: int) -> Callable[[int], None]:
        for b in bars:
            b.close()
        bar = tqdm(total=total, desc=f"{name:>13}", unit="prog", leave=False)
        bars.append(bar)
        return bar.update

    return make


def writable_parent(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for an output file: a usage error now, not a traceback after a long run, when the file
    could not be written (``hintflow replay --json``, ``hintflow run --json``)."""
    if value is not None:
        parent = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(parent):
            raise click.BadParameter(f"directory {parent!r} does not exist")
        if not os.access(parent, os.W_OK):
            raise click.BadParameter(f"directory {parent!r} is not writable")
    return value


@click.command("replay")
@click.option("--backend", type=click.Choice(["modeled", "vllm"]), default="modeled", show_default=True,
              help="modeled: our engine schedulers on virtual time (--executor); vllm: real vLLM servers "
                   "from .venv-vllm in real time, one per policy, same model and KV pool (policies: vanilla, "
                   "hintflow-infer, hintflow-infer-pid, hintflow-orchestrator, and continuum, kvflow, thunderagent "
                   "pushing hints to hintflow's node, each also as MODE+host; defaults: the tiny model, 40 programs, token "
                   "scale 0.1 for swe-agent and 0.2 for the other generators, outputs <= 32 tokens)")
@click.option("--workload", "-w", default="swe-agent", show_default=True,
              help="generator (swe-agent, multi-agent, human-in-loop, skewed[:k=v,...]), hintflow:FILE, "
                   "mooncake:FILE, trie:FILE or a .jsonl trace; skewed: 400 programs at 2/s, 80% sharing one "
                   "hot prefix, 10% long-running with contexts about 5x the others' (meant for --nodes 4)")
@click.option("--policy", "-p", "policies", default="all", show_default=True,
              help=f"comma-separated: {', '.join(REPLAY_CONFIGS)}; with --backend vllm: vanilla, "
                   "hintflow-infer, hintflow-infer-pid, hintflow-orchestrator, continuum, kvflow, thunderagent, "
                   "each also as MODE+host")
@click.option("--variant", "variants", multiple=True, metavar="NAME=BASE:KEY=VALUE,...",
              help="a policy with some knobs turned, reported as NAME beside the others (repeatable): "
                   "BASE is a policy above (or an earlier variant); keys: its fields (routing, "
                   "eviction_policy, host_tier, cold_prefill_cap, ...), policy.KEY (rel_change, "
                   "min_change_s, renew_ahead_s, pause.min_samples, pause.default_mean_s, pause.capacity) and "
                   "scheduler.KEY (SchedulerConfig: max_num_seqs, cold_prefill_budget_tokens, "
                   "program_fcfs_aging_s, ...), e.g. 'eager=hintflow:policy.rel_change=0.02'; with --backend "
                   "vllm: BASE a mode, keys policy.KEY (modes that push hints) and env.HINTFLOW_* (the node's "
                   "settings), a +host mode's variant named NAME+host, e.g. "
                   "'T+host=hintflow-orchestrator+host:policy.measured_price=false'")
@click.option("--nodes", "num_nodes", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--executor", type=click.Choice(["modeled", "torch"]), default="modeled", show_default=True,
              help="modeled: steps priced by the cost model; torch: the tiny torch model computes every step "
                   "on this CPU and a step lasts its measured wall time (defaults: cpu-tiny, 16-token "
                   "blocks, 40 programs, a fifth of the modeled token scale)")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Poisson program arrivals per second [workload default; a trace's own times for files]")
@click.option("--programs", "num_programs", type=click.IntRange(min=1), default=None,
              help="number of programs (generators) or the first N of a file [workload default]")
@click.option("--kv-capacity-tokens", type=click.IntRange(min=1), default=None,
              help="device KV per node [a third of the live programs' contexts per node]")
@click.option("--host-capacity-tokens", type=click.IntRange(min=0), default=None,
              help="host KV memory per node, for the policies that use one; with --backend vllm, the "
                   "host tier of the MODE+host policies [--host-memory; vllm: every program's longest]")
@click.option("--host-memory", type=click.Choice(["short", "all"]), default="short", show_default=True,
              help="without --host-capacity-tokens: host memory of half the device pool (short), or for every "
                   "live context (all: every keep-context design keeps every context)")
@click.option("--cost-model", default=None,
              help="bundled profile name (cpu-tiny, h200-llama3-8b, h100-llama3-8b, a100-llama3-8b) or a JSON file "
                   "[h100-llama3-8b; cpu-tiny with --executor torch]")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="KV block size of the replayed nodes (copy cost rescaled) [128; 16 with --executor torch]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ttft-deadline", "ttft_deadline_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="hintflow's nodes: a request that has waited this long goes ahead of pins and program "
                   "order (SchedulerConfig.ttft_deadline_s) [off]")
@click.option("--link-gb-per-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="the network between nodes, for the policies that move contexts (hintflow): GB/s, "
                   "priced with the cost model's KV bytes per token [the cost model's host copy rate]")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="multiply every token count [workload default: 0.25 for swe-agent, else 1; with "
                   "--executor torch 0.05 for swe-agent, 0.2 for multi-agent and human-in-loop]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=writable_parent, help="write the report as JSON here")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=writable_parent, help="write one row per policy (every figure of the JSON's policies) here")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None,
              help="write PNG plots (JCT CDF, across-turn hits, device memory) into this folder")
@click.option("--progress/--no-progress", default=True, show_default=True, help="tqdm bar per policy")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="policies replayed at once in worker processes (modeled executor; same reports) "
                   "[the CPU count, at most one per policy; 1 with --executor torch]")
@click.option("--vllm-python", default=None, help="vllm: the Python that has vLLM  [default: .venv-vllm]")
@click.option("--model", "vllm_model", type=click.Path(file_okay=False), default=None,
              help="vllm: model folder  [default: the tiny model, built in --state-dir]")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="vllm: servers' caches, logs, per-program results  [default: TMPDIR/hintflow-replay-vllm]")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="vllm: run every policy this many times in turn (the order reversed every other round); "
                   "the table gives medians and each policy's ratio to the same round's vanilla")
@click.option("--bracket", is_flag=True, default=False,
              help="vllm: run stock (vanilla, or vanilla+host for a +host policy) before and after every other "
                   "policy in each round, and give each policy's ratio to the stock runs either side of it "
                   "(a machine that drifts during the sitting cancels out; one more stock run per policy)")
@click.pass_context
def replay_command(ctx: click.Context, backend: str, workload: str, policies: str, variants: tuple[str, ...],
                   num_nodes: int, executor: str,
                   rate: float | None, num_programs: int | None, kv_capacity_tokens: int | None,
                   host_capacity_tokens: int | None, host_memory: str, cost_model: str | None,
                   block_size: int | None, seed: int,
                   ttft_deadline_s: float | None, link_gb_per_s: float | None, scale: float | None,
                   json_out: str | None, csv_out: str | None,
                   plots_dir: str | None, progress: bool, jobs: int | None, vllm_python: str | None,
                   vllm_model: str | None, state_dir: str | None, rounds: int, bracket: bool) -> None:
    """Replay an agent workload under each policy and print the side-by-side table."""
    from replay._vllm_backend import check_backend_options

    check_backend_options(ctx, backend)
    if backend == "vllm":
        from replay._vllm_backend import vllm_replay

        vllm_replay(ctx, _tqdm_progress(progress))
        return
    from replay._plots import write_plots
    from replay._report import (
        bound_note,
        dump_json,
        oracle_note,
        overload_note,
        render_table,
        report_json,
        step_time_check,
        write_csv,
    )
    from replay._setup import ReplaySetup, run_replay

    defined: list[ReplayConfig] = []
    try:
        for text in variants:
            defined.append(parse_variant(text, defined))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--variant") from None
    try:
        configs = parse_policy_list(policies, defined)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--policy") from None
    if unused := [v.name for v in defined if v not in configs]:
        click.echo(f"note: --variant {', '.join(unused)} not in --policy, so not replayed", err=True)
    setup = ReplaySetup(workload=workload, num_programs=num_programs, rate=rate, num_nodes=num_nodes,
                        kv_capacity_tokens=kv_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
                        host_memory=host_memory, cost_model=cost_model, seed=seed, scale=scale, block_size=block_size, executor=executor,
                        ttft_deadline_s=ttft_deadline_s, link_gb_per_s=link_gb_per_s)
    t0 = time.perf_counter()
    try:
        if jobs is None:
            jobs = 1 if executor == "torch" else max(1, len(os.sched_getaffinity(0)))
        setup, results = run_replay(setup, configs, progress=_tqdm_progress(progress), jobs=jobs)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    wall_s = time.perf_counter() - t0
    report = report_json(setup, results)
    report["config"]["wall_s"] = wall_s
    n = len(results[0].programs)
    steps = "torch nodes, measured step times" if executor == "torch" else "modeled executor"
    click.echo(f"{workload}: {n} programs, {num_nodes} node(s), {steps}, token scale {setup.scale:g}, "
               f"{setup.block_size}-token blocks, device KV {setup.kv_capacity_tokens:,} tokens/node, "
               f"host {setup.host_capacity_tokens:,} tokens/node, cost model {setup.cost_model}, "
               f"{wall_s:.1f} s wall")
    click.echo(render_table(report))
    for note in (overload_note(report), oracle_note(report), bound_note(report)):
        if note:
            click.echo(note)
    if executor == "torch":
        click.echo(step_time_check(report))
    if json_out:
        dump_json(report, json_out)
        click.echo(f"JSON: {json_out}")
    if csv_out:
        write_csv(report, csv_out)
        click.echo(f"CSV: {csv_out}")
    if plots_dir:
        written = write_plots(results, plots_dir)
        click.echo(written if isinstance(written, str) else "plots: " + ", ".join(map(str, written)))
