"""``hintflow replay``: every policy side by side on one workload, on the modeled executor's virtual time.

Thin by design: options become a ``ReplaySetup`` and a list of ``ReplayConfig``; ``run_replay`` does the
work; ``_report`` prints, writes and draws.  Registered on the main group by ``hintflow/cli.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from replay._policies import REPLAY_CONFIGS, parse_policy_list

__all__ = ["replay_command"]


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


@click.command("replay")
@click.option("--workload", "-w", default="swe-agent", show_default=True,
              help="generator (swe-agent, multi-agent, human-in-loop[:k=v,...]), hintflow:FILE, "
                   "mooncake:FILE, trie:FILE or a .jsonl trace")
@click.option("--policy", "-p", "policies", default="all", show_default=True,
              help=f"comma-separated: {', '.join(REPLAY_CONFIGS)}")
@click.option("--nodes", "num_nodes", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--executor", type=click.Choice(["modeled", "torch"]), default="modeled", show_default=True)
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Poisson program arrivals per second [workload default; a trace's own times for files]")
@click.option("--programs", "num_programs", type=click.IntRange(min=1), default=None,
              help="number of programs (generators) or the first N of a file [workload default]")
@click.option("--kv-capacity-tokens", type=click.IntRange(min=1), default=None,
              help="device KV per node [a third of the live programs' contexts per node]")
@click.option("--host-capacity-tokens", type=click.IntRange(min=0), default=None,
              help="host KV memory per node, for the policies that use one [all live contexts]")
@click.option("--cost-model", default="h100-llama3-8b", show_default=True,
              help="bundled profile name (cpu-tiny, h100-llama3-8b, a100-llama3-8b) or a JSON file")
@click.option("--block-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="KV block size of the replayed nodes (copy cost rescaled)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="multiply every token count [workload default: 0.25 for swe-agent, else 1]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="write the report as JSON here")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None,
              help="write PNG plots (JCT CDF, across-turn hits, device memory) into this folder")
@click.option("--progress/--no-progress", default=True, show_default=True, help="tqdm bar per policy")
def replay_command(workload: str, policies: str, num_nodes: int, executor: str, rate: float | None,
                   num_programs: int | None, kv_capacity_tokens: int | None, host_capacity_tokens: int | None,
                   cost_model: str, block_size: int, seed: int, scale: float | None, json_out: str | None,
                   plots_dir: str | None, progress: bool) -> None:
    """Replay an agent workload under each policy and print the side-by-side table."""
    from replay._report import dump_json, render_table, report_json, write_plots
    from replay._setup import ReplaySetup, run_replay

    if executor == "torch":
        raise click.UsageError("--executor torch is not implemented yet; use --executor modeled")
    try:
        configs = parse_policy_list(policies)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--policy") from None
    setup = ReplaySetup(workload=workload, num_programs=num_programs, rate=rate, num_nodes=num_nodes,
                        kv_capacity_tokens=kv_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
                        cost_model=cost_model, seed=seed, scale=scale, block_size=block_size)
    t0 = time.perf_counter()
    try:
        setup, results = run_replay(setup, configs, progress=_tqdm_progress(progress))
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    wall_s = time.perf_counter() - t0
    report = report_json(setup, results)
    report["config"]["wall_s"] = wall_s
    n = len(results[0].programs)
    click.echo(f"{workload}: {n} programs, {num_nodes} node(s), device KV {setup.kv_capacity_tokens:,} "
               f"tokens/node, host {setup.host_capacity_tokens:,} tokens/node, {cost_model}, "
               f"{wall_s:.1f} s wall")
    click.echo(render_table(report))
    if json_out:
        dump_json(report, json_out)
        click.echo(f"JSON: {json_out}")
    if plots_dir:
        written = write_plots(results, plots_dir)
        click.echo(written if isinstance(written, str) else "plots: " + ", ".join(map(str, written)))
