"""Where memory is short: every policy over several seeds, device-only and with a short host tier.

    python scripts/memory_short.py [--workloads swe-agent,multi-agent] [--seeds 0-7] [--jobs 2] [--json OUT]
                                   [--policies vllm-default,continuum,hintflow,bound]
    python scripts/memory_short.py --from-json OUT      # the tables again, from a run's --json

For each workload, memory point and seed, the replay's default setup (two nodes, its default device pool)
with a host tier of none (``device-only``) or half the device pool (``short-host``), every registered
policy on one code path. Prints, per workload and point, the mean over seeds of each policy's mean / p90 /
p99 JCT and p50 / p99 TTFT, and hintflow's ratios to the best online baseline, to ``bound`` (the
finite-memory reference) and to ``oracle``, seed by seed, and how much better than the best baseline
``bound`` itself is (what finite memory leaves to win). ``--policies``: a subset of the registered rows
(``hintflow`` and ``vllm-default`` are always run: the ratios need them). Virtual time: any machine gives these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from typing import Any

from replay import ANALYSIS_ROWS, REPLAY_CONFIGS, ReplaySetup, get_replay_config, report_json, run_replay

POINTS = {"device-only": 0.0, "short-host": 0.5}  # host tier as a share of the device pool
KEYS = ("jct_mean_s", "jct_p90_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s")


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def measure(workload: str, point: str, seed: int, jobs: int, names: list[str]) -> dict[str, dict[str, float]]:
    setup = ReplaySetup(workload=workload, seed=seed).with_defaults()
    progs = setup.load_programs()
    device = setup.resolve(progs, setup.cost()).kv_capacity_tokens  # the replay's default pool
    assert device is not None
    host = int(POINTS[point] * device)
    configs = [get_replay_config(n) for n in names]
    resolved, results = run_replay(replace(setup, host_capacity_tokens=host), configs, jobs=jobs)
    pols = report_json(resolved, results)["policies"]
    return {name: {k: m[k] for k in KEYS} for name, m in pols.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="swe-agent,multi-agent")
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--seeds", default="0-7", help="a seed or a range, e.g. 0-7")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--policies", default=",".join(REPLAY_CONFIGS), help="registered rows to run")
    ap.add_argument("--from-json", help="print the tables of an earlier --json output (runs nothing)")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            for key, runs in json.load(f).items():
                workload, _, point = key.partition("/")
                _print(workload, point, {int(seed): r for seed, r in runs.items()})
        return
    names = [n for n in REPLAY_CONFIGS if n in {"hintflow", "vllm-default", *a.policies.split(",")}]
    unknown = set(a.policies.split(",")) - set(REPLAY_CONFIGS)
    if unknown:
        ap.error(f"unknown policies {', '.join(sorted(unknown))}; known: {', '.join(REPLAY_CONFIGS)}")
    out: dict[str, Any] = {}
    for workload in a.workloads.split(","):
        for point in a.points.split(","):
            runs = {seed: measure(workload, point, seed, a.jobs, names) for seed in _seeds(a.seeds)}
            out[f"{workload}/{point}"] = runs
            _print(workload, point, runs)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


def _print(workload: str, point: str, runs: dict[int, dict[str, dict[str, float]]]) -> None:
    names = list(next(iter(runs.values())))
    print(f"\n{workload}, {point}, seeds {min(runs)}-{max(runs)} (mean over seeds)")
    print("| policy | JCT mean | JCT p90 | JCT p99 | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|---|")
    for n in names:
        cells = [statistics.fmean(r[n][k] for r in runs.values()) for k in KEYS]
        print(f"| {n} | " + " | ".join(f"{c:.2f} s" for c in cells) + " |")
    online = [n for n in names if n not in ANALYSIS_ROWS and n != "hintflow"]
    print("| seed | best baseline (mean) | hintflow / best: mean, p90 | hintflow / bound: mean, p90 "
          "| TTFT p99 hintflow / vllm-default | online rows below the bound | best / bound: mean, p90 |\n"
          "|---|---|---|---|---|---|---|")
    for seed, r in runs.items():
        best = min(online, key=lambda n: r[n]["jct_mean_s"])
        h, b = r["hintflow"], r.get("bound")
        below = [n for n in names if n not in ANALYSIS_ROWS and b is not None
                 and (r[n]["jct_mean_s"] < b["jct_mean_s"] or r[n]["jct_p90_s"] < b["jct_p90_s"])]
        best_p90 = min(r[n]["jct_p90_s"] for n in online)
        vs_bound = (f"{h['jct_mean_s'] / b['jct_mean_s']:.2f}, {h['jct_p90_s'] / b['jct_p90_s']:.2f}"
                    if b is not None else "-")
        room = (f"{r[best]['jct_mean_s'] / b['jct_mean_s']:.2f}, {best_p90 / b['jct_p90_s']:.2f}"
                if b is not None else "-")
        print(f"| {seed} | {best} {r[best]['jct_mean_s']:.2f} s | {h['jct_mean_s'] / r[best]['jct_mean_s']:.2f}, "
              f"{h['jct_p90_s'] / best_p90:.2f} | {vs_bound} | "
              f"{h['ttft_p99_s'] / r['vllm-default']['ttft_p99_s']:.2f} | {', '.join(below) or 'none'} | {room} |")


if __name__ == "__main__":
    main()
