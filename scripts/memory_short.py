"""Where memory is short: every policy over several seeds, device-only and with a short host tier.

    python scripts/memory_short.py [--workloads swe-agent,multi-agent] [--seeds 0-7] [--jobs 2] [--json OUT]
                                   [--policies vllm-default,continuum,hintflow,bound]
    python scripts/memory_short.py --from-json OUT      # the tables again, from a run's --json
    python scripts/memory_short.py --workloads multi-agent --points device-only --tail-bar 0.8,0.95 ...

For each workload, memory point and seed, the replay's default setup (two nodes, its default device pool)
with a host tier of none (``device-only``) or half the device pool (``short-host``), every registered
policy on one code path. Prints, per workload and point, the mean over seeds of each policy's mean / p90 /
p99 JCT and p50 / p99 TTFT, and hintflow's ratios to the best online baseline, to ``bound`` (the
finite-memory reference) and to ``oracle``, seed by seed, and how much better than the best baseline
``bound`` itself is (what finite memory leaves to win). ``--policies``: a subset of the registered rows
(``hintflow`` and ``vllm-default`` are always run: the ratios need them). Virtual time: any machine gives these figures.

``--tail-bar F,...``: what the JCT bar costs under the TTFT bar. For each seed and point, ``bound`` and
``hintflow`` again with a TTFT deadline of F times vllm-default's own p99 TTFT on that seed and point
(rows ``bound.tailF``, ``hintflow.tailF``; knowing vllm-default's tail ahead is part of the bound's clairvoyance),
and a table of the best of those rows whose p99 TTFT is at most vllm-default's, against the best baseline:
how much better than the best baseline any of these policies can be while its tail keeps the bar.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from replay import (
    ANALYSIS_ROWS,
    REPLAY_CONFIGS,
    ReplayConfig,
    ReplaySetup,
    get_replay_config,
    parse_variant,
    report_json,
    run_replay,
)

POINTS = {"device-only": 0.0, "short-host": 0.5}  # host tier as a share of the device pool
KEYS = ("jct_mean_s", "jct_p90_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s")


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


TAIL_BASES = ("bound", "hintflow")  # the rows run again under the tail bar


def measure(workload: str, point: str, seed: int, jobs: int, names: list[str],
            tail_bar: Sequence[float] = ()) -> dict[str, dict[str, float]]:  # fmt: skip
    setup = ReplaySetup(workload=workload, seed=seed).with_defaults()
    progs = setup.load_programs()
    device = setup.resolve(progs, setup.cost()).kv_capacity_tokens  # the replay's default pool
    assert device is not None
    setup = replace(setup, host_capacity_tokens=int(POINTS[point] * device))

    def run(configs: list[ReplayConfig]) -> dict[str, dict[str, float]]:
        resolved, results = run_replay(setup, configs, jobs=jobs)
        return {name: {k: m[k] for k in KEYS} for name, m in report_json(resolved, results)["policies"].items()}

    out = run([get_replay_config(n) for n in names])
    if tail_bar:
        vd_p99 = out["vllm-default"]["ttft_p99_s"]
        variants = [parse_variant(f"{b}.tail{f:g}={b}:scheduler.ttft_deadline_s={f * vd_p99:.2f}")
                    for f in tail_bar for b in TAIL_BASES]  # fmt: skip
        out |= run(variants)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="swe-agent,multi-agent")
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--seeds", default="0-7", help="a seed or a range, e.g. 0-7")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--policies", default=",".join(REPLAY_CONFIGS), help="registered rows to run")
    ap.add_argument("--from-json", help="print the tables of an earlier --json output (runs nothing)")
    ap.add_argument("--tail-bar", default="", help="deadline factors F,...: bound and hintflow again with a "
                    "TTFT deadline of F x vllm-default's p99 TTFT (see above)")
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
            bar = [float(f) for f in a.tail_bar.split(",") if f.strip()]
            if any(not f > 0 for f in bar):
                ap.error(f"--tail-bar factors must be > 0, got {a.tail_bar!r}")
            runs = {seed: measure(workload, point, seed, a.jobs, names, bar) for seed in _seeds(a.seeds)}
            out[f"{workload}/{point}"] = runs
            _print(workload, point, runs)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


def _print(workload: str, point: str, runs: dict[int, dict[str, dict[str, float]]]) -> None:
    names = [n for n in next(iter(runs.values())) if ".tail" not in n]
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
    if any(".tail" in n for r in runs.values() for n in r):
        _print_tail_bar(runs, online)


def _print_tail_bar(runs: dict[int, dict[str, dict[str, float]]], online: list[str]) -> None:
    """Per seed, the best ``bound.tailF`` and ``hintflow.tailF`` rows whose p99 TTFT is at most vllm-default's."""
    print("\nUnder the TTFT bar (p99 TTFT at most vllm-default's), against the best baseline's mean and p90:")
    print("| seed | vllm-default TTFT p99 | bound under the bar: row, mean / p90 | best / it (mean, p90) "
          "| hintflow under the bar: row, mean / p90 | best / it (mean, p90) |\n|---|---|---|---|---|---|")
    for seed, r in runs.items():
        bar = r["vllm-default"]["ttft_p99_s"]
        best_mean = min(r[n]["jct_mean_s"] for n in online)
        best_p90 = min(r[n]["jct_p90_s"] for n in online)
        cells = []
        for base in TAIL_BASES:
            ok = [n for n in r if n.startswith(f"{base}.tail") and r[n]["ttft_p99_s"] <= bar]
            if not ok:
                cells += ["none keeps the bar", "-"]
                continue
            n = min(ok, key=lambda n: r[n]["jct_mean_s"])
            m = r[n]
            cells += [f"{n}, {m['jct_mean_s']:.2f} / {m['jct_p90_s']:.2f} s",
                      f"{best_mean / m['jct_mean_s']:.2f}, {best_p90 / m['jct_p90_s']:.2f}"]
        print(f"| {seed} | {bar:.2f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
