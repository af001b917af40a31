"""PNG plots of replay results: JCT CDF, across-turn hit rate, device memory over time (matplotlib, optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from replay._report import metrics
from replay._sim import SimResult

__all__ = ["write_plots"]


def write_plots(results: Sequence[SimResult], out_dir: str | Path) -> list[Path] | str:
    """JCT CDF, across-turn hit rate and device memory over time, as PNGs in ``out_dir``.

    Returns the files written, or a message saying why none were (matplotlib is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plots written (pip install matplotlib)"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        jct = np.sort([p.jct_s for p in r.programs])
        ax.plot(jct, np.arange(1, len(jct) + 1) / len(jct), label=r.config.name)
    ax.set(xlabel="job completion time (s)", ylabel="fraction of programs", title="JCT CDF", xscale="log")
    ax.legend()
    paths.append(out / "jct_cdf.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.config.name for r in results]
    ax.bar(names, [metrics(r)["across_turn_hit_rate"] for r in results])
    ax.set(ylabel="across-turn hit rate", ylim=(0, 1), title="KV found across turn boundaries")
    ax.tick_params(axis="x", rotation=30)
    paths.append(out / "across_turn_hits.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        by_t: dict[float, int] = {}
        for t, _, used, _, _ in r.memory:
            by_t[t] = by_t.get(t, 0) + used
        ts = sorted(by_t)
        ax.plot(ts, [by_t[t] for t in ts], label=r.config.name, linewidth=0.8)
    ax.set(xlabel="virtual time (s)", ylabel="device KV in use, all nodes (tokens)", title="Device memory")
    ax.legend()
    paths.append(out / "device_memory.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths
