"""Why a returning turn recomputed part of its history, for both engines: the pause's pin fate, or its wait.

A turn's recomputed tokens (history its session computed before, not found cached at admission) are told
apart by cause, so an operator sees which rule loses contexts (docs/tuning.md, "Where contexts are lost"):

- ``queued``: cached when the turn arrived, evicted while it waited in the queue;
- otherwise what became of the session's context in the pause before the turn (``PAUSE_FATES``, kept on
  each engine's session as ``pause_fate``): its pin held it whole (``pinned``: what is left is the unfilled
  last block, which a prefix cache of whole blocks does not keep), the pin budget let it hold only a
  prefix or nothing (``clamped``), the pin yielded to an older program's waiting turn (``yielded``), the
  deadlock rule dropped it (``forced``), its lease ran out (``expired``), or it had no pin (``unpinned``).

Why one module: the vLLM node (``vllm_backend._accounting``) and the embedded node (``_scheduler``) split
the same way, and the replay's report of a mirrored node reads beside the real node's log line.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LOST_CAUSES", "LOST_METRIC", "PAUSE_FATES", "after_grant", "after_unpin", "lost_shares", "split_lost"]

PAUSE_FATES = ("pinned", "clamped", "yielded", "forced", "expired", "unpinned")
"""What became of a session's context in the pause since its last turn (see the module docstring)."""

LOST_CAUSES = ("queued", *PAUSE_FATES)

_LOSSES = frozenset({"clamped", "yielded", "forced", "expired"})
"""Fates that record an event that let the context go: a later pin in the same pause does not undo it (a
policy renewing a lapsed lease pins what is left, which is not the context the pause began with)."""

LOST_METRIC = (
    "hintflow_recomputed_tokens_by_cause_total",
    "Across-turn prompt tokens recomputed at a turn's admission, by why their KV was not there: queued, or the"
    " pause's pin fate (pinned, clamped, yielded, forced, expired, unpinned).",
)
"""The Prometheus counter both nodes export, labelled ``cause`` (a preemption's redo is not in it)."""


def after_grant(fate: str, *, whole: bool, clamped: bool, held: bool) -> str:
    """The pause's fate once a pin is granted: a loss recorded earlier stays; a context that already lost
    blocks with no pin stays ``unpinned``; else ``clamped`` if the budget cut the pin, ``pinned`` if it
    holds blocks. ``whole``: nothing of the context had gone when the pin came."""
    if fate in _LOSSES or not whole:
        return fate
    return "clamped" if clamped else "pinned" if held else fate


def after_unpin(fate: str) -> str:
    """The pause's fate once its pin is taken back (a zero TTL, an explicit hint replacing an inferred pin):
    ``unpinned`` from now on, unless a loss was recorded earlier."""
    return fate if fate in _LOSSES else "unpinned"


def split_lost(history: int, hit: int, fate: str, cached_at_arrival: int) -> list[tuple[str, int]]:
    """The recomputed part of ``history`` (tokens not among the ``hit`` ones found at admission), as
    ``(cause, tokens)``: what was cached at arrival and lost while waiting is ``queued``, the rest ``fate``.
    Empty when nothing of the history was recomputed."""
    if fate not in PAUSE_FATES:
        raise ValueError(f"pause fate {fate!r} is not one of {', '.join(PAUSE_FATES)}")
    lost = history - min(hit, history)
    if lost <= 0:
        return []
    queued = min(lost, max(0, min(cached_at_arrival, history) - hit))
    return [(cause, n) for cause, n in (("queued", queued), (fate, lost - queued)) if n]


def lost_shares(lost_by: Mapping[str, int]) -> str:
    """``cause:share`` of the recomputed tokens, largest first (a log line's ``lost=``; ``-``: none)."""
    total = sum(lost_by.values())
    if not total:
        return "-"
    ranked = sorted(lost_by.items(), key=lambda kv: -kv[1])
    return ",".join(f"{cause}:{n / total:.2f}" for cause, n in ranked)
