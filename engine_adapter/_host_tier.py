"""The host tier: device blocks copied out to host memory on eviction, and back in on a prefetch.

A copy is queued as a ``CopyOp`` (``pending_copies``) that the executor runs before the next forward
pass; ``take_copies`` hands them over.  Why apart from ``_session_table``: this is the one place blocks
move between tiers (``KVCacheManager.attach`` queues the reloads of an admitted turn).
"""

from __future__ import annotations

from ._executor import CopyOp
from ._session import Session
from ._session_table import SessionTable

__all__ = ["HostTier"]


class HostTier(SessionTable):
    """Offload, host allocation and drops, prefetch (``KVCacheManager`` is the class to use)."""

    def _evict_one(self, s: Session) -> None:
        """Take the session's last unpinned device block: to the host tier if it can hold it, else drop."""
        if len(s.block_ids) <= s.pinned_blocks:
            raise RuntimeError(f"session {s.session_id} has no evictable block")
        bid = s.block_ids[-1]
        moved = False
        # A block shared with another session is copied out too: it leaves this context's chain, and the
        # host blocks behind it are reachable only through a host copy of it.
        if self.host.num_blocks:
            hb = self._allocate_host(exclude=s)
            if hb is not None:
                self.pending_copies.append(CopyOp("d2h", bid, hb))
                s.host_block_ids.insert(0, hb)
                self.stats.offloaded_blocks += 1
                moved = True
        if not moved and s.host_block_ids:
            self._drop_host(s, len(s.host_block_ids))  # behind a dropped block they are unreachable
        s.block_ids.pop()
        del s.block_hashes[len(s.block_ids) :]
        s.epoch += 1
        self.device.unref(bid)
        self.stats.evicted_blocks += 1
        if not s.block_ids:
            self.stats.evicted_sessions += 1
        self._refresh(s)

    def _allocate_host(self, exclude: Session) -> int | None:
        now = self.clock.now()
        while not self.host.can_allocate(1):
            victim = self._host_holders.best(now)
            if victim is None:
                return None
            self._drop_host(victim, 1)
        return self.host.allocate(1)[0]

    def _drop_host(self, s: Session, n: int) -> None:
        for _ in range(min(n, len(s.host_block_ids))):
            self.host.unref(s.host_block_ids.pop())
            self.stats.dropped_host_blocks += 1
            s.epoch += 1
        self._refresh(s)

    def _prefetch(self, s: Session) -> None:
        """Reload host blocks into *free* device blocks only: a prefetch never evicts anyone.

        Nor does it take free blocks while a queued turn waits for memory: that turn would have to evict
        (offload) someone to get back the very blocks the prefetch took, so a guess about a future turn
        would cost a turn that is ready now (measured in replay: about 70% more offloads, a longer queue).
        The prefetch is dropped; the session's turn reloads its host blocks on admission instead.
        """
        if self._any_waiting():
            self.stats.skipped_prefetches += 1
            return
        n = min(len(s.host_block_ids), self.device.num_free_blocks)
        if n <= 0:
            return
        dev = self.device.allocate(n)
        for db in dev:
            hb = s.host_block_ids.pop(0)
            self.pending_copies.append(CopyOp("h2d", hb, db))
            self.host.unref(hb)
            s.block_ids.append(db)
            s.epoch += 1
        self._rehash(s)
        self.stats.prefetched_blocks += n
        self._refresh(s)

    def take_copies(self) -> list[CopyOp]:
        ops, self.pending_copies = self.pending_copies, []
        return ops
