"""Turn by turn: a real vLLM run beside the replay's mirror of its node (``vllm_predict.py --turns MODE``).

Why: a mirror can match a run's mean JCT and still keep the wrong contexts or queue the wrong turns. The
comparison that found the host tier's reload rule (8391904) joined each real turn to the same turn of the
same program in the mirror and binned both by when the turn was sent and by how long its tool paused:
hits that agree overall disagreed by 8 points for turns back within a second. This module is that join,
as pure functions over a report's ``programs[MODE]`` (per turn: ``sent_s``, ``ttft_s``, ``latency_s``,
``cached_tokens``, ``already_sent_tokens``) and the replay's ``TurnRecord``s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnPair", "bin_table", "format_turns", "pair_turns", "quantile", "tail_table"]


@dataclass(frozen=True, slots=True)
class TurnPair:
    """One turn, as the real node served it and as the mirror did."""

    program: str
    index: int
    sent_s: float  # when the real client sent it (s since the run began)
    pause_s: float  # the real tool pause before it (nan for a first turn)
    history_tokens: int  # what the program had sent before this turn (0 for a first turn)
    real_found_tokens: int  # of that history, what the real node found cached
    mirror_found_tokens: int  # of the mirror's history, what its node found (device + host tier)
    mirror_history_tokens: int
    real_ttft_s: float
    mirror_ttft_s: float

    @property
    def first(self) -> bool:
        return self.index == 0


def pair_turns(real_programs: Iterable[dict[str, Any]], mirror_turns: Iterable[Any]) -> list[TurnPair]:
    """Join a report's programs (``programs[MODE]``) with the mirror's turn records by (program, turn index).

    A real turn the mirror did not run (a failed program, a trace cut short) is left out, and so is a
    mirror turn the real run lacks: only what both served is compared."""
    mirror = {(t.program_id, t.turn_index): t for t in mirror_turns}
    pairs = []
    for prog in real_programs:
        turns = prog["turns"]
        for i, t in enumerate(turns):
            m = mirror.get((prog["program"], i))
            if m is None:
                continue
            prev = turns[i - 1] if i else None
            pause = t["sent_s"] - (prev["sent_s"] + prev["latency_s"]) if prev is not None else math.nan
            history = int(t["already_sent_tokens"]) if i else 0
            pairs.append(TurnPair(
                prog["program"], i, t["sent_s"], pause, history, min(int(t["cached_tokens"]), history),
                min(m.device_hit_tokens + m.host_hit_tokens, m.history_tokens) if i else 0,
                m.history_tokens if i else 0, t["ttft_s"], m.ttft_s,
            ))  # fmt: skip
    return pairs


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation (nan for no values)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _share(found: int, total: int) -> float:
    return found / total if total else math.nan


def bin_table(pairs: Sequence[TurnPair], key: Callable[[TurnPair], float], width: float, *, cap: float = math.inf,
              title: str) -> list[str]:  # fmt: skip
    """Markdown rows of returning turns binned by ``key`` (bins ``width`` wide, the last one open from
    ``cap``): how many, the share of history found (real, mirror), the mean and p90 TTFT (real, mirror)."""
    bins: dict[float, list[TurnPair]] = {}
    for p in pairs:
        if p.first or math.isnan(key(p)):
            continue
        k = min(math.floor(key(p) / width) * width, cap)
        bins.setdefault(k, []).append(p)
    rows = [f"| {title} | turns | history found, real / mirror | TTFT mean, real / mirror | TTFT p90, real / mirror |",
            "|---|---|---|---|---|"]  # fmt: skip
    for k in sorted(bins):
        b = bins[k]
        label = f"{k:g}+" if k >= cap else f"{k:g}–{k + width:g}"
        real = _share(sum(p.real_found_tokens for p in b), sum(p.history_tokens for p in b))
        mir = _share(sum(p.mirror_found_tokens for p in b), sum(p.mirror_history_tokens for p in b))
        rt, mt = [p.real_ttft_s for p in b], [p.mirror_ttft_s for p in b]
        rows.append(f"| {label} | {len(b)} | {real:.0%} / {mir:.0%} | {sum(rt) / len(b):.2f} / {sum(mt) / len(b):.2f} s | "
                    f"{quantile(rt, 0.9):.2f} / {quantile(mt, 0.9):.2f} s |")  # fmt: skip
    return rows


def tail_table(pairs: Sequence[TurnPair]) -> list[str]:
    """TTFT p50 / p90 / p99, real and mirror, for first turns, returning turns and all: where the tail is."""
    rows = ["| turns | n | TTFT p50, real / mirror | p90 | p99 |", "|---|---|---|---|---|"]
    for name, sel in (("first", [p for p in pairs if p.first]), ("returning", [p for p in pairs if not p.first]),
                      ("all", list(pairs))):  # fmt: skip
        if not sel:
            continue
        rt, mt = [p.real_ttft_s for p in sel], [p.mirror_ttft_s for p in sel]
        cells = [f"{quantile(rt, q):.2f} / {quantile(mt, q):.2f} s" for q in (0.5, 0.9, 0.99)]
        rows.append(f"| {name} | {len(sel)} | " + " | ".join(cells) + " |")
    return rows


def _slowest(pairs: Sequence[TurnPair], n: int, *, by_mirror: bool) -> list[str]:
    side = "mirror" if by_mirror else "real"
    rows = [f"slowest first tokens, {side}: program turn, sent at, pause, history found real / mirror, TTFT real / mirror"]
    for p in sorted(pairs, key=lambda p: p.mirror_ttft_s if by_mirror else p.real_ttft_s, reverse=True)[:n]:
        pause = "first" if p.first else f"{p.pause_s:.2f} s"
        found = "-" if p.first else (f"{_share(p.real_found_tokens, p.history_tokens):.0%} / "
                                     f"{_share(p.mirror_found_tokens, p.mirror_history_tokens):.0%}")  # fmt: skip
        rows.append(f"  {p.program} t{p.index}, {p.sent_s:.1f} s, {pause}, {found}, "
                    f"{p.real_ttft_s:.2f} / {p.mirror_ttft_s:.2f} s")  # fmt: skip
    return rows


def format_turns(pairs: Sequence[TurnPair], *, time_bin_s: float = 10.0, num_slowest: int = 8) -> str:
    """The whole comparison as text: by send time, by pause, the TTFT tail, and the slowest turns."""
    if not pairs:
        return "no turn that both the real run and the mirror served"
    out = bin_table(pairs, lambda p: p.sent_s, time_bin_s, title="sent at (s)") + [""]
    out += bin_table(pairs, lambda p: p.pause_s, 1.0, cap=8.0, title="pause (s)") + [""]
    out += tail_table(pairs) + [""]
    out += _slowest(pairs, num_slowest, by_mirror=False) + _slowest(pairs, num_slowest, by_mirror=True)
    return "\n".join(out)
