"""Per-turn facts the diagnosis is built from: how much of the prompt repeats the previous one, what could
have been cached, what was, where the prefix broke and how, and how busy the run was when the call began.

Kept apart from the verdicts (``_diagnose``) so the report's plots and the terminal tables read the same
numbers.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from dataclasses import dataclass

from diagnose._readers import Run
from diagnose._records import Segment, TurnRecord, common_prefix

__all__ = ["Break", "TurnFacts", "turn_facts"]


@dataclass(frozen=True, slots=True)
class Break:
    """Where a turn's prompt stopped matching the previous turn's: the block, what happened to it, and
    how many tokens after that point had to be sent (and prefilled) again."""

    block: str  # tools, system, prefix, message, history
    change: str  # "reordered", "edited", "added", "removed", "changed", "rewritten"
    segment_index: int
    lost_tokens: int

    @property
    def early(self) -> bool:
        return self.block in ("tools", "system", "prefix")

    def describe(self) -> str:
        what = {"tools": "tool definitions", "system": "system prompt", "prefix": "fixed prefix"}.get(
            self.block, "history message")
        return f"{what} {self.change}"


@dataclass(slots=True)
class TurnFacts:
    rec: TurnRecord
    index: int  # position in its session
    prompt_tokens: int
    repeated_tokens: int  # leading tokens equal to the session's previous prompt
    could_cache_tokens: int  # the longest prefix sent before anywhere in the run
    brk: Break | None
    pause_before_s: float | None
    tool_before: str | None
    in_flight_at_start: int  # other calls running when this one started (a burst measure)

    @property
    def reuse_fraction(self) -> float:
        return self.repeated_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cached_fraction(self) -> float | None:
        c = self.rec.cached_tokens
        return None if c is None or not self.prompt_tokens else c / self.prompt_tokens

    @property
    def cold(self) -> bool | None:
        """Found less than half of what it could have found cached (None when nothing was reported)."""
        c = self.rec.cached_tokens
        if c is None:
            return None
        return self.could_cache_tokens > 0 and c < 0.5 * self.could_cache_tokens


def _tools_change(prev: Segment, cur: Segment) -> str:
    if prev.items and cur.items:
        if Counter(prev.items) == Counter(cur.items):
            return "reordered"
        if set(prev.items) < set(cur.items):
            return "added"
        if set(cur.items) < set(prev.items):
            return "removed"
    return "edited"


def find_break(prev: TurnRecord, cur: TurnRecord) -> Break | None:
    """The first segment of ``prev`` that ``cur`` did not repeat, or None when ``cur`` extends ``prev``."""
    n = common_prefix(prev.segments, cur.segments)
    if n >= len(prev.segments):
        return None
    lost = sum(s.num_tokens for s in prev.segments[n:])
    p = prev.segments[n]
    c = cur.segments[n] if n < len(cur.segments) else None
    if c is None:
        return Break(p.block, "removed", n, lost)
    if p.block == "tools" and c.block == "tools":
        return Break("tools", _tools_change(p, c), n, lost)
    if p.block != c.block:
        return Break(p.block, "removed" if p.is_early else "rewritten", n, lost)
    return Break(p.block, "changed" if p.is_early else "rewritten", n, lost)


def _chain(segments: tuple[Segment, ...]) -> list[str]:
    """Cumulative hashes: entry k names the prompt's first k+1 segments (a prefix's identity)."""
    out, h = [], ""
    for s in segments:
        h = hashlib.sha256((h + s.block + s.hash).encode()).hexdigest()[:16]
        out.append(h)
    return out


def turn_facts(run: Run) -> list[TurnFacts]:
    """Facts for every turn, in start-time order where known (else session order)."""
    sessions = run.sessions()
    ordered = sorted((t for items in sessions.values() for t in items),
                     key=lambda t: (t.start_unix_s if t.start_unix_s is not None else float("inf"), t.key, t.turn))
    position = {(t.key, t.turn): i for items in sessions.values() for i, t in enumerate(items)}
    previous = {(t.key, t.turn): items[i - 1] for items in sessions.values() for i, t in enumerate(items) if i}
    starts = sorted(t.start_unix_s for t in ordered if t.start_unix_s is not None)
    ends = sorted(t.start_unix_s + (t.latency_s or 0.0) for t in ordered if t.start_unix_s is not None)
    seen: set[str] = set()
    out: list[TurnFacts] = []
    for t in ordered:
        prev = previous.get((t.key, t.turn))
        chain = _chain(t.segments)
        known = 0
        for k, h in enumerate(chain):
            if h in seen:
                known = k + 1
        could = sum(s.num_tokens for s in t.segments[:known])
        seen.update(chain)
        repeated, brk = 0, None
        if prev is not None:
            if t.segments and prev.segments:
                repeated = sum(s.num_tokens for s in t.segments[:common_prefix(prev.segments, t.segments)])
                brk = find_break(prev, t)
            else:  # counts only (a usage log): the previous prompt is assumed to be a prefix
                repeated = min(prev.prompt_tokens, t.prompt_tokens)
            could = max(could, repeated)
        in_flight = 0
        if t.start_unix_s is not None:  # calls started before this one and not yet finished
            in_flight = bisect.bisect_left(starts, t.start_unix_s) - bisect.bisect_right(ends, t.start_unix_s)
        out.append(TurnFacts(t, position[(t.key, t.turn)], t.prompt_tokens, repeated, could, brk,
                             prev.pause_s if prev is not None else None, prev.tool if prev is not None else None,
                             max(0, in_flight)))
    return out
