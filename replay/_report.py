"""From replay results to numbers: per-policy metrics, the side-by-side tables, JSON and CSV (plots: ``_plots.py``).

Hit rates follow the engine's metric definitions (``engine_adapter/_metrics.py``):

* ``across_turn_hit_rate``: of the tokens a session computed in earlier turns (its history), the fraction
  its next prompt found on device or reloaded from host; a host reload is a hit, and its copy time is
  inside the step that runs the turn, so it is inside TTFT;
* ``within_turn_hit_rate``: of the prompt tokens that are not the session's history (new input, a shared
  system prompt), the fraction found cached: prefixes shared with other sessions;
* ``prompt_hit_rate``: all hits over all prompt tokens.

Ratios in the table are ``policy / baseline`` for times (below 1 is faster) and tokens.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapter import LOST_CAUSES
from replay._setup import ReplaySetup
from replay._sim import SimResult

__all__ = ["ANALYSIS_ROWS", "NO_MIGRATIONS", "REQUIRED_KEYS", "bound_note", "dump_json", "metrics",
           "migration_table", "oracle_note", "overload_note", "render_table", "report_json", "step_time_check", "write_csv"]

REQUIRED_KEYS = ("jct_mean_s", "jct_p50_s", "jct_p90_s", "jct_p99_s", "ttft_p50_s", "ttft_p90_s",
                 "ttft_p99_s", "across_turn_hit_rate", "within_turn_hit_rate", "recomputed_tokens",
                 "throughput_tokens_per_s")


NO_MIGRATIONS: dict[str, Any] = {"migrations": 0, "migrated_tokens": 0, "migrated_bytes": 0,
                                 "migration_transfer_s": 0.0, "failed_migrations": 0}
"""What a configuration that moves no contexts reports (``_migration.py``: bytes are tokens times the cost
model's ``kv_bytes_per_token``, None where the profile does not say; time is the copies' time on the link)."""


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def metrics(result: SimResult) -> dict[str, Any]:
    """Every reported figure of one configuration's replay (seconds, tokens, fractions)."""
    turns, runs = result.turns, result.programs
    jct = [r.jct_s for r in runs]
    ttft = [t.ttft_s for t in turns]
    wait = [t.queue_wait_s for t in turns]
    history = sum(t.history_tokens for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    output = sum(t.output_tokens for t in turns)
    hits = sum(t.hit_tokens for t in turns)
    across = sum(t.across_hit_tokens for t in turns)
    moves = 0  # a migrated turn also runs on another node, but took its context along
    last_node: dict[str, str] = {}
    for t in sorted(turns, key=lambda t: t.ready_s):
        moves += int(last_node.setdefault(t.session_key, t.node) != t.node and not t.migrated_tokens)
        last_node[t.session_key] = t.node
    stats = [n.kv_stats for n in result.node_totals]
    m: dict[str, Any] = {
        "jct_mean_s": float(np.mean(jct)) if jct else 0.0,
        "jct_p50_s": _pct(jct, 50), "jct_p90_s": _pct(jct, 90), "jct_p99_s": _pct(jct, 99),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "queue_wait_mean_s": float(np.mean(wait)) if wait else 0.0,
        "queue_wait_p50_s": _pct(wait, 50), "queue_wait_p90_s": _pct(wait, 90),
        "across_turn_hit_rate": _ratio(across, history),
        "within_turn_hit_rate": _ratio(hits - across, prompt - history),
        "prompt_hit_rate": _ratio(hits, prompt),
        "history_tokens": history,  # the across-turn rate's denominator (0: "n/a" in the table)
        "prompt_tokens": prompt,
        "host_hit_tokens": sum(t.host_hit_tokens for t in turns),
        "recomputed_tokens": sum(t.recomputed_tokens for t in turns),
        "computed_prompt_tokens": sum(t.computed_tokens for t in turns),
        "throughput_tokens_per_s": _ratio(output, result.makespan_s),
        "throughput_programs_per_s": _ratio(len(runs), result.makespan_s),
        "prompt_throughput_tokens_per_s": _ratio(prompt, result.makespan_s),
        "pinned_token_seconds": sum(n.pinned_token_s for n in result.node_totals),
        # contexts copied to another node with their turn: 0 unless the configuration moves them (``extra``)
        **NO_MIGRATIONS,
        "session_moves": moves,
        "preemptions": sum(n.num_preemptions for n in result.node_totals),
        "evicted_blocks": sum(s.evicted_blocks for s in stats),
        "offloaded_blocks": sum(s.offloaded_blocks for s in stats),
        "reloaded_blocks": sum(s.reloaded_blocks for s in stats),
        "pin_expiries": sum(s.pin_expiries for s in stats),
        # recomputed history by why the context was not there (engine_adapter/_lost_context.py; the vLLM
        # node's log line gives the same split as lost=)
        "lost_by": {c: n for c in LOST_CAUSES if (n := sum(s.lost_by.get(c, 0) for s in stats))},
        "num_programs": len(runs),
        "num_turns": len(turns),
        "makespan_s": result.makespan_s,
        "wall_s": result.wall_s,
        "num_steps": sum(n.num_steps for n in result.node_totals),
        # the executor's work: tokens run forward, step time on the clock (measured on torch, else modeled)
        # and the cost model's price of the same steps (equal to step_s on the modeled executor)
        "step_tokens": sum(n.num_step_tokens for n in result.node_totals),
        "step_s": sum(n.step_s for n in result.node_totals),
        "modeled_step_s": sum(n.modeled_step_s for n in result.node_totals),
        # what the measured pin price reads (over the run, all nodes): the share of step time spent
        # prefilling, and of returning turns' contexts no pin held, the share still on the device
        "prefill_share": _ratio(sum(n.prefill_s for n in result.node_totals),
                                sum(n.step_s for n in result.node_totals)),
        "unpinned_kept_rate": _ratio(sum(n.unpinned_kept_tokens for n in result.node_totals),
                                     sum(n.unpinned_tokens for n in result.node_totals)),
        "num_events": result.num_events,
    }
    m.update(result.extra)
    return m


def report_json(setup: ReplaySetup, results: Sequence[SimResult]) -> dict[str, Any]:
    """``{"policies": {name: metrics}, "config": setup and each policy's configuration}``."""
    config = dataclasses.asdict(setup)
    if setup.executor == "torch":
        config["step_time"] = (f"measured: wall time (time.perf_counter) of each real TorchExecutor step "
                               f"on this machine, {setup.torch_threads} torch thread(s); the cost model "
                               f"{setup.cost_model} prices policies, routing and sizing, and modeled_step_s")
    else:
        config.pop("torch_threads")
        config["step_time"] = f"modeled: cost model {setup.cost_model}"
    # the coefficients the steps were priced with, so a report stays readable when a profile changes
    # (offload_overlaps_compute changed the GPU profiles' figures at commit 2d0e1bc)
    config["cost_model_coefficients"] = setup.cost().model_dump(exclude={"source", "fit"})
    config["link_s_per_token"] = setup.link_s_per_token(setup.cost())  # what a migration's copy took per token
    config["policy_configs"] = {r.config.name: dataclasses.asdict(r.config) for r in results}
    return {"policies": {r.config.name: metrics(r) for r in results}, "config": config}


_TIMES = (("JCT mean", "jct_mean_s", "s"), ("p50", "jct_p50_s", "s"), ("p90", "jct_p90_s", "s"),
          ("p99", "jct_p99_s", "s"), ("TTFT p50", "ttft_p50_s", "s"), ("p90", "ttft_p90_s", "s"),
          ("p99", "ttft_p99_s", "s"), ("queue wait", "queue_wait_mean_s", "s"))
_WORK = (("across-turn hits", "across_turn_hit_rate", "%"), ("within-turn hits", "within_turn_hit_rate", "%"),
         ("recomputed", "recomputed_tokens", "n"), ("tok/s", "throughput_tokens_per_s", "f"),
         ("pinned tok·s", "pinned_token_seconds", "n"), ("preemptions", "preemptions", "f"),
         ("session moves", "session_moves", "f"), ("migrations", "migrations", "f"),
         ("prefill share", "prefill_share", "%"), ("unpinned kept", "unpinned_kept_rate", "%"))


def _cell(value: float, kind: str, base: dict[str, float]) -> str:
    if kind == "%":
        return f"{value:.1%}"
    text = f"{value:,.0f}" if kind in ("n", "f") else f"{value:.2f} s"
    ratios = [f"{value / b:.2f}×" for b in base.values() if b and kind != "f"]
    return f"{text} ({' / '.join(ratios)})" if ratios else text


def _no_denominator(m: dict[str, Any], key: str) -> bool:
    """A hit rate of no tokens at all (no session had history, or every prompt token was history)."""
    if key == "across_turn_hit_rate":
        return bool(m.get("history_tokens", 1) == 0)
    if key == "within_turn_hit_rate":
        return bool(m.get("prompt_tokens", 1) - m.get("history_tokens", 0) == 0)
    return False


def _table(pols: dict[str, Any], refs: list[str], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    lines = ["| policy | " + " | ".join(c[0] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, m in pols.items():
        cells = []
        for _, key, kind in columns:
            if _no_denominator(m, key):
                cells.append("n/a")
                continue
            base = {r: pols[r][key] for r in refs if r != name}
            cells.append(_cell(m[key], kind, base if name not in refs else {}))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def render_table(report: dict[str, Any]) -> str:
    """Two markdown tables, times (JCT and TTFT percentiles, queue wait) and work (hits, recomputed tokens,
    throughput, pins, preemptions, moves); times and token counts carry their ratios to vllm-default, to
    the finite-memory ``bound`` and to the infinite-memory ``oracle``, those of them that ran.
    ``session moves``: turns that ran on another node than the session's last turn (its context
    re-prefilled there); ``migrations``: contexts copied to another node with their turn (``_migration.py``)."""
    pols = report["policies"]
    refs = [n for n in ("vllm-default", "bound", "oracle") if n in pols]
    lines = _table(pols, refs, _TIMES) + [""] + _table(pols, refs, _WORK)
    if refs:
        lines.append(f"\nratios in parentheses: × {' / × '.join(refs)}")
    if movers := migration_table(report):
        lines += ["", movers]
    return "\n".join(lines)


def migration_table(report: dict[str, Any]) -> str:
    """The contexts each configuration that moves them copied between nodes: how many, their tokens and bytes,
    their time on the link, and the moves the receiving node had no room for (empty when none moves any)."""
    configs = report.get("config", {}).get("policy_configs", {})
    movers = {n: m for n, m in report["policies"].items()
              if configs.get(n, {}).get("migrate") or m.get("migrations") or m.get("failed_migrations")}
    if not movers:
        return ""
    lines = ["| policy | migrations | migrated tokens | GB | transfer time | failed imports |", "|---" * 6 + "|"]
    for name, m in movers.items():
        gb = "n/a" if m.get("migrated_bytes") is None else f"{m['migrated_bytes'] / 1e9:.2f}"
        lines.append(f"| {name} | {m['migrations']:,} | {m['migrated_tokens']:,} | {gb} | "
                     f"{m['migration_transfer_s']:.2f} s | {m['failed_migrations']:,} |")
    others = [n for n in report["policies"] if n not in movers]
    if others:
        lines.append(f"\n{', '.join(others)}: move no contexts between nodes (a session they move is recomputed)")
    return "\n".join(lines)


def overload_note(report: dict[str, Any], share: float = 0.5) -> str:
    """A warning when even the policy that queued least spent over ``share`` of its programs' time queued:
    the nodes cannot serve the load, and the figures compare backlogs, not serving (empty otherwise)."""
    queued: dict[str, float] = {}
    for name, m in report["policies"].items():
        job_s = m["jct_mean_s"] * m["num_programs"]
        if job_s > 0:
            queued[name] = m["queue_wait_mean_s"] * m["num_turns"] / job_s
    if not queued or min(queued.values()) <= share:
        return ""
    best = min(queued, key=lambda n: queued[n])
    parallel = " (a program's parallel turns each count)" if queued[best] > 1.0 else ""
    return (f"note: the nodes are overloaded: even {best}'s turns spent {queued[best]:.0%} of its programs' time "
            f"queued{parallel}, so these figures compare backlogs; for serving figures add nodes (--nodes) or "
            f"lower the load (--rate, --programs)")


def oracle_note(report: dict[str, Any]) -> str:
    """A warning when the oracle's pool, sized to hold every context, evicted anything (empty otherwise)."""
    m = report["policies"].get("oracle")
    if m is None or not m["evicted_blocks"]:
        return ""
    return (f"note: the oracle evicted {m['evicted_blocks']:,} blocks, so it is not the bound it should be "
            f"here; its pool is sized from the programs' unloaded lifetimes (replay._setup._peak_held_tokens)")


ANALYSIS_ROWS = frozenset({"bound", "oracle", "clairvoyant"})
"""Rows that know the future (or have infinite memory): references, not policies a node could run."""


def bound_note(report: dict[str, Any]) -> str:
    """A warning when an online row beat the finite-memory ``bound`` on mean or p90 JCT: on this run the
    bound is too weak to measure the gap against (empty otherwise)."""
    pols = report["policies"]
    b = pols.get("bound")
    if b is None:
        return ""
    beat = [
        f"{name} ({label} {m[key]:.2f} s < {b[key]:.2f} s)"
        for name, m in pols.items() if name not in ANALYSIS_ROWS
        for label, key in (("mean", "jct_mean_s"), ("p90", "jct_p90_s")) if m[key] < b[key]
    ]  # fmt: skip
    if not beat:
        return ""
    return f"note: online rows beat the bound on JCT here, so it is not a bound on this run: {', '.join(beat)}"


def step_time_check(report: dict[str, Any]) -> str:
    """Per policy: the steps' measured time against the cost model's price of the same steps."""
    cm = report["config"]["cost_model"]
    lines = [f"step time, measured vs {cm}'s price of the same steps (steps, tokens run forward):"]
    for name, m in report["policies"].items():
        ratio = _ratio(m["step_s"], m["modeled_step_s"])
        lines.append(f"  {name}: {m['step_s']:.2f} s vs {m['modeled_step_s']:.2f} s ({ratio:.2f}×), "
                     f"{m['num_steps']:,} steps, {m['step_tokens']:,} tokens")
    return "\n".join(lines)


def dump_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def write_csv(report: dict[str, Any], path: str | Path) -> None:
    """One row per policy, one column per scalar figure of ``metrics`` (the JSON's ``policies``), for tables
    over seeds or runs; a figure one policy lacks (ThunderAgent's pause counts) is empty in the others' rows."""
    rows = [{"policy": name, **{k: v for k, v in m.items() if v is None or isinstance(v, int | float | str)}}
            for name, m in report["policies"].items()]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
