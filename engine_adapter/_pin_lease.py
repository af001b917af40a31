"""Pin leases and the pin budget, written once for both engines.

A ``Pin(session, ttl_s)`` is a lease: the session's context is held on the device until the node's clock
passes ``now + ttl_s``, or its next turn is admitted, whichever comes first; a lease that runs out while
that next turn waits in the queue holds on until admission (the turn is back: letting go now would make
it recompute what it came for). Pins hold at most a budget of *distinct* device blocks, a fraction of the
pool: a prefix shared by two pinned sessions costs once.

The embedded node (``_session_table.SessionTable``) and the vLLM node (``vllm_backend._sessions.SessionBook``)
hold pinned blocks on different structures (block ids in a session's table; references on vLLM's own
``KVCacheBlock``\\s), so this module keeps only what the two share: each session's lease (its deadline and a
sequence number that tells a renewed lease from a stale heap entry), the expiry heap, and the count of pins
on each block against the budget. Which pins give way early is ``_pin_order``'s.

Sessions are duck-typed (:class:`Leased`): they carry ``pin_deadline_s`` and ``pin_seq``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

__all__ = ["Leased", "PinLeases"]


class Leased(Protocol):
    session_id: str
    pin_deadline_s: float | None
    pin_seq: int


S = TypeVar("S", bound=Leased)


class PinLeases:
    """The leases and pinned-block counts of one node (callers hold the node's lock)."""

    def __init__(self, num_blocks: int, pin_budget_fraction: float) -> None:
        if not 0.0 <= pin_budget_fraction < 1.0:
            raise ValueError(f"pin_budget_fraction must be in [0, 1), got {pin_budget_fraction}")
        self.budget_blocks = int(pin_budget_fraction * num_blocks)
        self._count: dict[int, int] = {}  # block id -> pins on it (distinct keys count against the budget)
        self._expiry: list[tuple[float, int, str]] = []  # (deadline, lease seq, session id)
        self._seq = itertools.count(1)

    # ---- leases --------------------------------------------------------------------------------
    def grant(self, s: Leased, now_s: float, ttl_s: float) -> None:
        """Start (or renew) the session's lease to ``now_s + ttl_s``; an earlier lease's entry goes stale."""
        s.pin_deadline_s = now_s + ttl_s
        s.pin_seq = next(self._seq)
        heapq.heappush(self._expiry, (s.pin_deadline_s, s.pin_seq, s.session_id))

    def reschedule(self, s: Leased) -> None:
        """Queue the session's current lease for expiry again (its entry was skipped while its turn waited)."""
        if s.pin_deadline_s is not None:
            heapq.heappush(self._expiry, (s.pin_deadline_s, s.pin_seq, s.session_id))

    def scheduled(self, s: Leased) -> bool:
        """Whether the session's current lease has an expiry entry (for invariant checks)."""
        return any(seq == s.pin_seq and sid == s.session_id for _, seq, sid in self._expiry)

    def next_due_s(self) -> float:
        """When the next lease may run out (``inf`` if none); early, never late, for renewed leases."""
        return self._expiry[0][0] if self._expiry else float("inf")

    def lapsed(self, now_s: float, find: Callable[[str], S | None], waiting: Callable[[S], bool]) -> Iterator[S]:
        """Sessions whose lease ran out by ``now_s``, their entries popped; the caller lets their pins go and
        sets ``pin_deadline_s = None``.  A session whose next turn is queued (``waiting``) is skipped: its
        lease holds until that turn is admitted (or, if the turn ends unadmitted, the engine re-queues or
        ends it there)."""
        while self._expiry and self._expiry[0][0] <= now_s:
            _, seq, sid = heapq.heappop(self._expiry)
            s = find(sid)
            if s is None or s.pin_seq != seq or s.pin_deadline_s is None or waiting(s):
                continue
            yield s

    # ---- the budget of distinct pinned blocks ----------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return len(self._count)

    def hold(self, block_id: int) -> bool:
        """Add a pin on the block; False (nothing changed) when it is not yet pinned and the budget is full."""
        n = self._count.get(block_id, 0)
        if not n and len(self._count) >= self.budget_blocks:
            return False
        self._count[block_id] = n + 1
        return True

    def let_go(self, block_id: int) -> None:
        """Remove one pin from the block (the last one unpins it)."""
        n = self._count[block_id] - 1
        if n:
            self._count[block_id] = n
        else:
            del self._count[block_id]

    def pins_on(self, block_id: int) -> int:
        return self._count.get(block_id, 0)

    def check(self, expected: dict[int, int]) -> None:
        """Raise unless the pin counts equal ``expected`` (block id -> pins the sessions hold) and fit."""
        if expected != self._count:
            raise AssertionError("pin counts disagree with sessions")
        if len(self._count) > max(self.budget_blocks, 0):
            raise AssertionError("pinned blocks over budget")
