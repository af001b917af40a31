"""Which parked context loses its blocks first: one scale for hinted and unhinted contexts.

Every parked session has a *reference time* ``r`` on the node clock:

* hinted (``EvictionOrder``/``Prefetch`` received): ``r`` = the predicted next-use deadline;
* unhinted: ``r`` = when it was last used.

Its predicted next use, as seen at ``now``, is::

    next_use(now) = r              if r > now   (a prediction that still lies ahead)
                  = now + (now-r)  if r <= now  (no prediction, or an overdue one: a context idle for d
                                                 is expected to stay idle about d more, the rule LRU
                                                 implies; it is continuous at r == now)

The victim is the session with the largest ``next_use(now)``.  So "needed in 40 s" outranks "idle for
60 s" (evicted later), an overdue hint decays into recency, and among unhinted contexts the order is
exactly LRU.  Two lazy heaps answer ``best(now)`` in O(log n) although keys move with time: the largest
``r`` among future ones, and the smallest ``r`` among past ones.

A policy is a small object that maps a session to ``r``; the mechanism above is shared by all of them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = [
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "HostLRUPolicy",
    "SessionHeap",
    "get_eviction_policy",
    "predicted_next_use",
]


class _HasEvictionRef(Protocol):
    last_used_s: float
    next_use_deadline_s: float | None


T = TypeVar("T")


def predicted_next_use(r: float, now: float) -> float:
    return r if r > now else 2.0 * now - r


class EvictionPolicy(Protocol):
    name: str

    def ref_time(self, session: _HasEvictionRef) -> float: ...


class HintedPolicy:
    """Ours: the hinted next-use deadline when there is one, else recency (see module docstring)."""

    name = "hinted"

    def ref_time(self, session: _HasEvictionRef) -> float:
        d = session.next_use_deadline_s
        return session.last_used_s if d is None else d


class LRUPolicy:
    """vLLM's default: hints ignored, least recently used first."""

    name = "lru"

    def ref_time(self, session: _HasEvictionRef) -> float:
        return session.last_used_s


class _HasHostClock(Protocol):
    host_used_s: float


class HostLRUPolicy:
    """A host tier's order as the vLLM node's connector keeps it (``vllm_backend/_host_index.py``): least
    recently *saved or loaded* first. A block goes to the end of the line when the device evicts it into
    the tier, not when its session last ran: a context evicted from the device a moment ago is the last the
    tier drops, while the host part of a turn that came back and waits, saved during its pause, goes
    before it. Ordered by the session's last turn instead (``LRUPolicy``, the mirrors' order until this
    class), the mirror of stock vLLM with a short host tier fitted its sitting at 0.018 rms log error
    against 0.006 (docs/benchmarks.md, "A queued turn holds its context", hp1)."""

    name = "host-lru"

    def ref_time(self, session: _HasHostClock) -> float:
        return session.host_used_s


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"hinted": HintedPolicy, "lru": LRUPolicy}


def get_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}") from None


class SessionHeap(Generic[T]):
    """A set of items with reference times; ``best(now)`` is the item with the largest predicted next use."""

    def __init__(self) -> None:
        self._future: list[tuple[float, int, T]] = []  # (-r, seq, item): largest r on top
        self._past: list[tuple[float, int, T]] = []  # (r, seq, item): smallest r on top
        self._live: dict[T, tuple[int, float]] = {}  # item -> (seq, r)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item in self._live

    def set(self, item: T, r: float) -> None:
        cur = self._live.get(item)
        if cur is not None and cur[1] == r:
            return
        seq = next(self._seq)
        self._live[item] = (seq, r)
        heapq.heappush(self._future, (-r, seq, item))
        heapq.heappush(self._past, (r, seq, item))
        if len(self._future) > 4 * len(self._live) + 64:
            self._compact()

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def _clean(self, heap: list[tuple[float, int, T]]) -> None:
        while heap:
            _, seq, item = heap[0]
            cur = self._live.get(item)
            if cur is not None and cur[0] == seq:
                return
            heapq.heappop(heap)

    def best(self, now: float) -> T | None:
        self._clean(self._future)
        self._clean(self._past)
        if not self._future:
            return None
        neg_r, _, fut_item = self._future[0]
        r_max = -neg_r
        r_min, _, past_item = self._past[0]
        if r_min > now:  # every prediction lies ahead
            return fut_item
        if r_max <= now:  # every reference lies behind
            return past_item
        return fut_item if r_max >= 2.0 * now - r_min else past_item

    def _compact(self) -> None:
        self._future = [(-r, seq, it) for it, (seq, r) in self._live.items()]
        self._past = [(r, seq, it) for it, (seq, r) in self._live.items()]
        heapq.heapify(self._future)
        heapq.heapify(self._past)
