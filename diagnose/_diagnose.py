"""Six questions about an agent loop (the seed article's diagnostic list), each answered with numbers and a
verdict from a run's turns:

1. ``prefix_reuse``: how much of each turn's prompt repeats the previous turn's;
2. ``reported_cache``: what the provider or engine reported as cached, against what could have been;
3. ``early_blocks``: which early block (tools, system, a fixed prefix) or history message changed when it
   need not have, and in which turn;
4. ``slow_turns``: whether the slow turns line up with cold starts, bursts, tool pauses or a route;
5. ``hotspot``: whether one warm node is a hotspot while others idle;
6. ``forced_cold``: whether the application forces cold prefills, or the serving side loses the reuse.

A question the source cannot answer (a replay trace has no latencies; a hosted API names no node) says
so, with status ``n/a``, instead of guessing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diagnose._readers import Run
from diagnose._turns import TurnFacts, turn_facts

__all__ = ["QUESTIONS", "Diagnosis", "Finding", "diagnose_run"]

QUESTIONS = {
    "prefix_reuse": "How much of the prefix is repeated from turn to turn?",
    "reported_cache": "What did the provider or engine report as cached, against what could have been?",
    "early_blocks": "Are tool definitions, system instructions or other early blocks changing when they need not?",
    "slow_turns": "Do slow turns line up with cold starts, bursts, tool pauses or a route?",
    "hotspot": "Is one warm node a hotspot while other capacity idles?",
    "forced_cold": "Is the application forcing cold prefills, or is the serving side losing the reuse?",
}
LONG_PAUSE_S = 300.0  # the shortest common provider cache TTL (Anthropic's default 5 minutes)


@dataclass
class Finding:
    key: str
    verdict: str
    status: str  # "ok", "warn", "bad", "n/a"
    numbers: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def question(self) -> str:
        return QUESTIONS[self.key]


@dataclass
class Diagnosis:
    source: str
    path: str
    num_programs: int
    num_sessions: int
    num_turns: int
    findings: list[Finding]
    facts: list[TurnFacts]

    def finding(self, key: str) -> Finding:
        return next(f for f in self.findings if f.key == key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "path": self.path, "num_programs": self.num_programs,
            "num_sessions": self.num_sessions, "num_turns": self.num_turns,
            "findings": {f.key: {"question": f.question, "status": f.status, "verdict": f.verdict,
                                 "numbers": f.numbers, "rows": f.rows} for f in self.findings},
            "turns": [{"program_id": x.rec.program_id, "session_id": x.rec.session_id, "turn": x.rec.turn,
                       "prompt_tokens": x.prompt_tokens, "repeated_tokens": x.repeated_tokens,
                       "could_cache_tokens": x.could_cache_tokens, "cached_tokens": x.rec.cached_tokens,
                       "break": None if x.brk is None else {"block": x.brk.block, "change": x.brk.change,
                                                             "lost_tokens": x.brk.lost_tokens},
                       "pause_before_s": x.pause_before_s, "tool_before": x.tool_before,
                       "ttft_s": x.rec.ttft_s, "latency_s": x.rec.latency_s, "node": x.rec.node or None}
                      for x in self.facts],
        }


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _prefix_reuse(facts: list[TurnFacts]) -> Finding:
    later = [f for f in facts if f.index > 0]
    if not later:
        return Finding("prefix_reuse", "every session has a single turn: nothing to repeat", "n/a")
    repeated = sum(f.repeated_tokens for f in later)
    total = sum(f.prompt_tokens for f in later)
    fractions = [f.reuse_fraction for f in later]
    share = repeated / total if total else 0.0
    low = [f for f in later if f.reuse_fraction < 0.5]
    status = "ok" if share >= 0.7 else ("warn" if share >= 0.4 else "bad")
    verdict = (f"{_pct(share)} of each later turn's prompt repeats the previous turn's (token-weighted); "
               f"{len(low)} of {len(later)} turns repeat less than half")
    return Finding("prefix_reuse", verdict, status,
                   {"repeated_fraction": round(share, 4), "median_turn_fraction": round(float(np.median(fractions)), 4),
                    "num_turns_below_half": len(low), "num_later_turns": len(later)},
                   [{"session_id": f.rec.session_id, "turn": f.rec.turn, "reuse_fraction": round(f.reuse_fraction, 4)}
                    for f in low[:50]])


def _reported(facts: list[TurnFacts]) -> Finding:
    known = [f for f in facts if f.rec.cached_tokens is not None]
    if not known:
        return Finding("reported_cache", "the source reports no cached tokens (a replay trace, or usage without "
                       "cache fields): nothing to compare", "n/a")
    cached = sum(f.rec.cached_tokens or 0 for f in known)
    could = sum(f.could_cache_tokens for f in known)
    ratio = cached / could if could else 1.0
    misses = [f for f in known if f.cold]
    long_pause = [f for f in misses if (f.pause_before_s or 0.0) > LONG_PAUSE_S]
    after_break = [f for f in misses if f.brk is not None]
    status = "ok" if ratio >= 0.8 else ("warn" if ratio >= 0.5 else "bad")
    verdict = (f"reported cached {cached:,} of {could:,} tokens that repeated an earlier prompt ({_pct(ratio)}); "
               f"{len(misses)} turns found less than half ({len(long_pause)} after a pause over "
               f"{LONG_PAUSE_S:.0f} s, {len(after_break)} after the prompt changed)")
    return Finding("reported_cache", verdict, status,
                   {"cached_tokens": cached, "could_cache_tokens": could, "ratio": round(ratio, 4),
                    "num_cold_turns": len(misses), "num_cold_after_long_pause": len(long_pause),
                    "num_cold_after_prompt_change": len(after_break)},
                   [{"session_id": f.rec.session_id, "turn": f.rec.turn, "cached_tokens": f.rec.cached_tokens,
                     "could_cache_tokens": f.could_cache_tokens, "pause_before_s": f.pause_before_s}
                    for f in misses[:50]])


def _early_blocks(facts: list[TurnFacts], run: Run) -> Finding:
    breaks = [f for f in facts if f.brk is not None]
    early = [f for f in breaks if f.brk is not None and f.brk.early]
    rows = [{"program_id": f.rec.program_id, "session_id": f.rec.session_id, "turn": f.rec.turn,
             "block": f.brk.block, "change": f.brk.change, "lost_tokens": f.brk.lost_tokens}
            for f in breaks if f.brk is not None]
    numbers = {"num_early_block_changes": len(early), "num_history_rewrites": len(breaks) - len(early),
               "lost_tokens": sum(f.brk.lost_tokens for f in breaks if f.brk is not None),
               "num_builder_warnings": len(run.warnings)}
    if not breaks:
        sessions = len({f.rec.key for f in facts})
        return Finding("early_blocks", f"stable prefix: every turn of the {sessions} sessions extends the "
                       "previous turn's prompt unchanged", "ok", numbers)
    first = early[0] if early else breaks[0]
    assert first.brk is not None
    where = f"turn {first.rec.turn} of session {first.rec.session_id}"
    verdict = (f"{first.brk.describe()} at {where} ({first.brk.lost_tokens:,} tokens sent again); "
               f"{len(early)} early-block changes and {len(breaks) - len(early)} history rewrites in all")
    return Finding("early_blocks", verdict, "bad" if early else "warn", numbers, rows[:100])


def _lift(slow: list[bool], flag: list[bool]) -> tuple[float, int]:
    """P(slow | flag) / P(slow | not flag), and how many slow turns have the flag."""
    s, f = np.asarray(slow), np.asarray(flag)
    with_f = s[f].mean() if f.any() else 0.0
    without = s[~f].mean() if (~f).any() else 0.0
    lift = float(with_f / without) if without > 0 else (float("inf") if with_f > 0 else 0.0)
    return lift, int((s & f).sum())


def _slow_turns(facts: list[TurnFacts]) -> Finding:
    timed = [f for f in facts if f.rec.speed_s is not None]
    if len(timed) < 5:
        return Finding("slow_turns", "fewer than 5 turns with a time to first token or latency: no slow-turn "
                       "analysis", "n/a")
    measure = "TTFT" if all(f.rec.ttft_s is not None for f in timed) else "latency (TTFT where reported)"
    speed = np.array([f.rec.speed_s for f in timed], dtype=float)
    threshold = float(np.quantile(speed, 0.9))
    slow = [bool(s >= threshold) and s > float(np.median(speed)) for s in speed]
    in_flight = np.array([f.in_flight_at_start for f in timed])
    pauses = [f.pause_before_s or 0.0 for f in timed]
    nodes = sorted({f.rec.node for f in timed if f.rec.node})
    factors: dict[str, list[bool]] = {
        "cold start": [bool(f.cold) or (f.index == 0) or f.brk is not None for f in timed],
        "burst": [bool(x > max(1.0, float(np.quantile(in_flight, 0.75)))) for x in in_flight],
        "long tool pause before": [p > max(LONG_PAUSE_S / 5, float(np.quantile(pauses, 0.75))) for p in pauses],
    }
    for node in nodes if len(nodes) > 1 else []:
        factors[f"route to {node}"] = [f.rec.node == node for f in timed]
    rows, best = [], None
    for name, flag in factors.items():
        lift, n = _lift(slow, flag)
        rows.append({"factor": name, "slow_turns_with_it": n, "turns_with_it": int(sum(flag)), "lift": round(lift, 2)
                     if lift != float("inf") else "inf"})
        if n >= max(1, sum(slow) // 2) and lift >= 2.0 and (best is None or lift > best[1]):
            best = (name, lift, n)
    reuse = np.array([f.reuse_fraction for f in timed])
    corr_pause = _spearman(np.array(pauses), speed)
    corr_reuse = _spearman(reuse, speed)
    numbers = {"measure": measure, "slow_threshold_s": round(threshold, 4), "num_slow": int(sum(slow)),
               "spearman_speed_vs_pause": corr_pause, "spearman_speed_vs_reuse": corr_reuse}
    if best is None:
        return Finding("slow_turns", f"the {sum(slow)} slowest turns ({measure} >= {threshold:.3f} s) line up "
                       "with no single factor (cold start, burst, long pause, route)", "ok", numbers, rows)
    lift_text = "only they" if best[1] == float("inf") else f"{best[1]:.1f}x the rate of the rest"
    return Finding("slow_turns", f"slow turns line up with {best[0]}: {best[2]} of the {sum(slow)} slowest "
                   f"({measure} >= {threshold:.3f} s) had it ({lift_text})", "warn", numbers, rows)


def _spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return round(float(np.corrcoef(rx, ry)[0, 1]), 3)


def _hotspot(facts: list[TurnFacts]) -> Finding:
    by_node: dict[str, list[TurnFacts]] = defaultdict(list)
    for f in facts:
        if f.rec.node:
            by_node[f.rec.node].append(f)
    if len(by_node) < 2:
        return Finding("hotspot", "fewer than two nodes recorded (a hosted API names none): no placement "
                       "to judge", "n/a", {"num_nodes": len(by_node)})
    busy = {n: sum(f.rec.latency_s or 0.0 for f in items) for n, items in by_node.items()}
    total_busy = sum(busy.values()) or 1.0
    rows: list[dict[str, Any]] = []
    for n, items in sorted(by_node.items()):
        waits = [f.rec.queue_wait_s for f in items if f.rec.queue_wait_s is not None]
        rows.append({"node": n, "turns": len(items), "busy_share": round(busy[n] / total_busy, 4),
                     "mean_queue_wait_s": round(float(np.mean(waits)), 4) if waits else None,
                     "warm_turn_share": round(float(np.mean([not f.cold for f in items if f.cold is not None]))
                                              if any(f.cold is not None for f in items) else 0.0, 4)})
    fair = 1.0 / len(by_node)
    hot = max(rows, key=lambda r: float(r["busy_share"]))
    idle = min(rows, key=lambda r: float(r["busy_share"]))
    numbers = {"num_nodes": len(by_node), "hottest": hot["node"], "hottest_share": hot["busy_share"],
               "idlest": idle["node"], "idlest_share": idle["busy_share"]}
    if hot["busy_share"] >= 1.5 * fair and idle["busy_share"] <= 0.5 * fair:
        return Finding("hotspot", f"{hot['node']} is a hotspot: {_pct(hot['busy_share'])} of the busy time "
                       f"while {idle['node']} had {_pct(idle['busy_share'])}", "bad", numbers, rows)
    return Finding("hotspot", f"load is spread: the busiest node ({hot['node']}) had {_pct(hot['busy_share'])} "
                   f"of the busy time across {len(by_node)} nodes", "ok", numbers, rows)


def _forced_cold(facts: list[TurnFacts]) -> Finding:
    app = [f for f in facts if f.brk is not None]
    app_tokens = sum(f.brk.lost_tokens for f in app if f.brk is not None)
    serving = [f for f in facts if f.brk is None and f.cold]
    serving_tokens = sum(f.could_cache_tokens - (f.rec.cached_tokens or 0) for f in serving)
    after_pause = [f for f in serving if (f.pause_before_s or 0.0) > LONG_PAUSE_S]
    numbers = {"app_forced_turns": len(app), "app_forced_tokens": app_tokens, "serving_lost_turns": len(serving),
               "serving_lost_tokens": serving_tokens, "serving_lost_after_long_pause": len(after_pause),
               "cache_reported": any(f.rec.cached_tokens is not None for f in facts)}
    parts = []
    if app:
        parts.append(f"the application forced {len(app)} cold prefills ({app_tokens:,} tokens) by changing "
                     "its prompt ahead of the new content")
    if serving:
        parts.append(f"the serving side lost reuse in {len(serving)} turns with an unchanged prefix "
                     f"({serving_tokens:,} tokens; {len(after_pause)} after a pause over {LONG_PAUSE_S:.0f} s: "
                     "see hintflow price for the TTL)")
    if not parts:
        tail = "" if numbers["cache_reported"] else " (no cache reports: only the application side was checked)"
        return Finding("forced_cold", "neither: the application keeps its prefix and the cache kept what "
                       "repeated" + tail, "ok", numbers)
    return Finding("forced_cold", "; ".join(parts), "bad" if app else "warn", numbers)


def diagnose_run(run: Run) -> Diagnosis:
    facts = turn_facts(run)
    findings = [_prefix_reuse(facts), _reported(facts), _early_blocks(facts, run), _slow_turns(facts),
                _hotspot(facts), _forced_cold(facts)]
    return Diagnosis(run.source, run.path, len({t.program_id for t in run.turns}), len(run.sessions()),
                     len(run.turns), findings, facts)
