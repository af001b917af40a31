"""A waiting turn's place in the queue under program FCFS, for both engines: a band, then a start time.

Both engines order waiting turns by priority class, then by this place: the band (0 first), then the
start (earlier first). The embedded node's ``Request.sort_key`` and the vLLM node's ``priority_for``
encode it each in their own key; the meaning is here once.

- **program FCFS with aging**: a turn is placed at its program's start, but at most ``aging_s`` before
  its own arrival, so an older program's turn gets a bounded head start over a newer arrival;
- **pinned first**: a turn whose session holds a pin goes ahead of every unpinned one (band 0). Its
  memory is reserved for it, so serving it turns the pin into progress and frees it. A lease that holds
  no blocks (the pin budget clamped it to nothing, or the context was gone when it was granted) reserves
  nothing, and its turn is placed as an unpinned one (``holds_pin``).
- **warm first** (``is_warm``): a turn whose prompt is cached but for at most ``WARM_THRESHOLD_TOKENS``
  (its context survived the pause, on the device or the host tier) goes ahead of cold ones (band 1, after
  pinned turns). It costs a few hundred tokens to serve now, while every step it waits its unpinned
  context may be evicted and the turn become a full re-prefill. The embedded scheduler admits warm turns
  in a pass before cold ones (``Scheduler.schedule``: pinned first within each pass, so a pinned cold
  turn there waits behind unpinned warm ones, which the vLLM node's bands do not make it do); the vLLM
  node keys them into band 1 (``vllm_backend/_warm.py``).

Tried and not kept (docs/benchmarks.md): bounding the pinned band's head start to a lead of some seconds,
and letting every pin give way to a turn that has waited past a bound; neither shortened the TTFT tail
on the real vLLM node, and the second cost hits and JCT.
"""

from __future__ import annotations

import math

__all__ = ["WARM_THRESHOLD_TOKENS", "holds_pin", "is_warm", "queue_place"]

WARM_THRESHOLD_TOKENS = 256
"""A turn with at most this many prompt tokens to compute (the rest cached) is warm."""


def holds_pin(pin_deadline_s: float | None, num_pinned_blocks: int) -> bool:
    """Whether a session's queued turn takes the pinned band: a live lease that holds blocks.

    Why blocks too: a pin's claim to go first is the memory it keeps for the turn. Under memory pressure
    most leases are clamped, many to nothing; counted as pinned, their turns (cold: nothing was kept) went
    ahead of every warm turn and every new program's first turn. On the real vLLM node, short host tier,
    two paired rounds: p99 TTFT 12-15% lower, mean JCT 1-6% higher (docs/benchmarks.md, "Batch width,
    and a lease without blocks")."""
    return pin_deadline_s is not None and num_pinned_blocks > 0


def is_warm(num_prompt_tokens: int, num_hit_tokens: int, threshold_tokens: int = WARM_THRESHOLD_TOKENS) -> bool:
    """Whether a turn is warm: at most ``threshold_tokens`` of its prompt left to compute."""
    return num_prompt_tokens - num_hit_tokens <= threshold_tokens


def queue_place(
    program_start_s: float, arrival_s: float, *, pinned: bool, warm: bool = False, aging_s: float | None = None
) -> tuple[int, float]:
    """``(band, start)`` of a waiting turn: band 0 pinned, 1 warm, 2 the rest; ``aging_s`` None or inf:
    strict program FCFS."""
    start = program_start_s
    if aging_s is not None and math.isfinite(aging_s):
        start = max(start, arrival_s - aging_s)
    return (0 if pinned else 1 if warm else 2), start
