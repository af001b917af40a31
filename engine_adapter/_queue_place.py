"""A waiting turn's place in the queue under program FCFS, for both engines: a band, then a start time.

Both engines order waiting turns by priority class, then by this place: the band (0 first), then the
start (earlier first). The embedded node's ``Request.sort_key`` and the vLLM node's ``priority_for``
encode it each in their own key; the meaning is here once.

- **program FCFS with aging**: a turn is placed at its program's start, but at most ``aging_s`` before
  its own arrival, so an older program's turn gets a bounded head start over a newer arrival;
- **pinned first**: a turn whose session holds a pin goes ahead of every unpinned one (band 0). Its
  memory is reserved for it, so serving it turns the pin into progress and frees it.

Tried and not kept (docs/benchmarks.md): bounding the pinned band's head start to a lead of some seconds,
and letting every pin give way to a turn that has waited past a bound; neither shortened the TTFT tail
on the real vLLM node, and the second cost hits and JCT.
"""

from __future__ import annotations

import math

__all__ = ["queue_place"]


def queue_place(program_start_s: float, arrival_s: float, *, pinned: bool, aging_s: float | None = None) -> tuple[int, float]:
    """``(band, start)`` of a waiting turn; ``aging_s`` None or inf: strict program FCFS."""
    start = program_start_s
    if aging_s is not None and math.isfinite(aging_s):
        start = max(start, arrival_s - aging_s)
    return (0 if pinned else 1), start
