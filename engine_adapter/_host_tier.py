"""The host tier: device blocks copied out to host memory on eviction, and back in on a prefetch.

A copy is queued as a ``CopyOp`` (``pending_copies``) that the executor runs before the next forward
pass; ``take_copies`` hands them over.  Why apart from ``_session_table``: this is the one place blocks
move between tiers (``KVCacheManager.attach`` queues the reloads of an admitted turn).

Two ways to fill it:

* on eviction (ours, the default): a device block is copied out when the device evicts it, so the host
  holds only what the device lost, and drops in the hinted order;
* write-through (``host_write_through``, a model of vLLM's host connectors, hintflow's and the native
  ``--kv-offloading-size`` alike): every turn's full blocks are copied out as the turn ends
  (``save_turn``; ``Session.saved_host_ids`` are those copies of the leading device blocks), an evicted
  block that has a copy just leaves the device, and the host drops least recently used chains first,
  tail first.  A host smaller than the device pool then holds mostly what the device holds too (the
  real connector gave 0.1% external hits at half the device pool): the replay uses it to predict a real
  vLLM node (``scripts/vllm_predict.py``).
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
        if self.host_write_through:
            moved = self._spill_saved(s, len(s.block_ids) - 1)
        # A block shared with another session is copied out too: it leaves this context's chain, and the
        # host blocks behind it are reachable only through a host copy of it.
        elif self.host.num_blocks:
            hb = self._allocate_host(exclude=s)
            if hb is not None:
                self.pending_copies.append(CopyOp("d2h", bid, hb))
                s.host_block_ids.insert(0, hb)
                s.host_used_s = self.clock.now()  # the tier's newest save (HostLRUPolicy)
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

    def _allocate_host(self, exclude: Session, *, spare: bool = False) -> int | None:
        """A free host block, dropping the first holder's tail blocks for it; None if there is none left
        (or, ``spare``, when the holder to drop from is ``exclude`` itself: a save never eats its own chain)."""
        now = self.clock.now()
        while not self.host.can_allocate(1):
            victim = self._host_holders.best(now)
            if victim is None or (spare and victim is exclude):
                return None
            self._drop_host(victim, 1)
        return self.host.allocate(1)[0]

    def _drop_host(self, s: Session, n: int) -> None:
        """Drop ``n`` host blocks of the chain's tail: those past the device prefix first, then the
        write-through copies of device blocks (the device blocks stay)."""
        for _ in range(min(n, len(s.host_block_ids) + len(s.saved_host_ids))):
            ids = s.host_block_ids or s.saved_host_ids
            self.host.unref(ids.pop())
            self.stats.dropped_host_blocks += 1
            s.epoch += 1
        self._refresh(s)

    # ---- write-through ---------------------------------------------------------------------------
    def save_turn(self, s: Session) -> int:
        """Write-through: copy the session's full device blocks that have no host copy yet, head first,
        making room by dropping least recently used chains (never this one's); how many were copied."""
        if not self.host_write_through:
            return 0
        s.last_used_s = s.host_used_s = self.clock.now()  # the chain being saved is the most recently used
        self._refresh(s)
        num_full = min(len(s.token_ids) // self.block_size, len(s.block_ids))
        n = 0
        while len(s.saved_host_ids) < num_full:
            hb = self._allocate_host(exclude=s, spare=True)
            if hb is None:
                break
            self.pending_copies.append(CopyOp("d2h", s.block_ids[len(s.saved_host_ids)], hb))
            s.saved_host_ids.append(hb)
            n += 1
        self.stats.offloaded_blocks += n
        if n:
            s.epoch += 1
            self._refresh(s)
        return n

    def _spill_saved(self, s: Session, keep: int) -> bool:
        """Write-through: the device blocks past ``keep`` leave; their host copies become the head of the
        host run, which stays reachable only if no unsaved block sits in between. Whether the first
        leaving block has a copy."""
        saved = s.saved_host_ids
        moved = saved[keep:]
        if len(saved) < len(s.block_ids) and s.host_block_ids:
            self._drop_host(s, len(s.host_block_ids))  # behind an unsaved block: unreachable
        s.host_block_ids[:0] = moved
        del saved[keep:]
        if moved:
            s.epoch += 1
        return bool(moved)

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
        # write-through: the host keeps its copies of the reloaded blocks while they extend the saved run
        keep_copies = self.host_write_through and len(s.saved_host_ids) == len(s.block_ids)
        for db in dev:
            hb = s.host_block_ids.pop(0)
            self.pending_copies.append(CopyOp("h2d", hb, db))
            if keep_copies:
                s.saved_host_ids.append(hb)
            else:
                self.host.unref(hb)
            s.block_ids.append(db)
            s.epoch += 1
        self._rehash(s)
        self.stats.prefetched_blocks += n
        self._refresh(s)

    def take_copies(self) -> list[CopyOp]:
        ops, self.pending_copies = self.pending_copies, []
        return ops
