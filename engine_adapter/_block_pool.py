"""Paged KV block pool: fixed-size blocks, reference counts, and a verified prefix-hash index.

A block is in exactly one of three places, and the pool's invariant is that they partition it::

    num_blocks = |held| + |free queue|
      held        ref_cnt > 0   a session context (or a running request through it) uses the block
      free queue  ref_cnt == 0  blank, or still holding a prefix that a later prompt may find by hash

The free queue's order *is* the reuse order (vLLM's idea): ``pop_free`` takes its head.  Blank blocks go
to the head, cached ones to the tail, so a cached prefix is overwritten only when no blank block is left.
Two orders are provided: LRU (the tail is the most recently freed or touched) and a keyed order (largest
key reused first; cache-replay uses it for Belady's next-use order).

Prefix blocks are found by a chained hash (parent hash seeds the hash of the block's tokens), and a hit is
only a hit when the stored tokens and parent hash equal the asked ones: a hash collision can cost a miss,
never a wrong context.

What ``lookup(h, ...)`` answers changes only when the index entry at ``h`` or the block behind it changes
(``register``, ``_forget``); a caller that keeps answers (the KV manager's prefix-plan memos) may ``watch``
the hashes it asked about and is told, through ``invalidate()``, the first time any of them changes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import numpy as np
import xxhash

__all__ = [
    "NONE_HASH",
    "Block",
    "BlockPool",
    "FreeQueue",
    "KeyedFreeQueue",
    "LRUFreeQueue",
    "hash_block_tokens",
]

NONE_HASH = 0  # parent hash of a context's first block


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained 64-bit hash: equal hashes imply (up to collisions) equal prefixes up to this block."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=parent_hash) or 1  # 0 is reserved for "no parent"


class Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_cnt", "token_key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and registered
        self.parent_hash = NONE_HASH
        self.token_key: Hashable | None = None  # what a hit is verified against (the block's tokens)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class Watcher(Protocol):
    def invalidate(self) -> None: ...


class FreeQueue(Protocol):
    def push_blank(self, block_id: int) -> None: ...
    def push_cached(self, block_id: int) -> None: ...
    def remove(self, block_id: int) -> None: ...
    def pop(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, block_id: int) -> bool: ...


class LRUFreeQueue:
    """O(1) doubly linked queue (an OrderedDict): blank blocks at the head, freed cached blocks at the tail."""

    def __init__(self) -> None:
        self._q: OrderedDict[int, None] = OrderedDict()

    def push_blank(self, block_id: int) -> None:
        self._q[block_id] = None
        self._q.move_to_end(block_id, last=False)

    def push_cached(self, block_id: int) -> None:
        self._q[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._q[block_id]

    def pop(self) -> int:
        return self._q.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._q


class KeyedFreeQueue:
    """Blank blocks first, then the cached block with the largest ``key(block_id)`` (read at push time)."""

    def __init__(self, key: Callable[[int], float]) -> None:
        self._key = key
        self._blank: list[int] = []
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[int, int] = {}  # block_id -> entry sequence number (lazy deletion)
        self._seq = itertools.count()

    def push_blank(self, block_id: int) -> None:
        self._blank.append(block_id)
        self._live[block_id] = -1

    def push_cached(self, block_id: int) -> None:
        seq = next(self._seq)
        self._live[block_id] = seq
        heapq.heappush(self._heap, (-self._key(block_id), seq, block_id))

    def remove(self, block_id: int) -> None:
        if self._live.pop(block_id) == -1:
            self._blank.remove(block_id)

    def pop(self) -> int:
        if self._blank:
            block_id = self._blank.pop()
            del self._live[block_id]
            return block_id
        while True:
            _, seq, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == seq:
                del self._live[block_id]
                return block_id

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live


class BlockPool:
    """Owns ``num_blocks`` blocks of one tier; callers own the meaning of what is in them."""

    def __init__(self, num_blocks: int, free_queue: FreeQueue | None = None, enable_prefix_index: bool = True):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: FreeQueue = free_queue if free_queue is not None else LRUFreeQueue()
        self.enable_prefix_index = enable_prefix_index
        self._index: dict[int, int] = {}  # block hash -> block id
        self._watchers: dict[int, set[Watcher]] = {}  # block hash -> who kept a lookup's answer there
        for i in range(num_blocks):
            self.free_queue.push_blank(i)

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks off the free queue (forgetting any prefix they held); ref_cnt becomes 1."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(self.free_queue)} free blocks")
        out = []
        for _ in range(n):
            block = self.blocks[self.free_queue.pop()]
            self._forget(block)
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def ref(self, block_id: int) -> None:
        """Take one more reference; a cached block is lifted off the free queue (a prefix hit)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            self.free_queue.remove(block_id)
        block.ref_cnt += 1

    def unref(self, block_id: int) -> bool:
        """Drop one reference. Returns True when the block went back to the free queue."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"unref of a free block {block!r}")
        block.ref_cnt -= 1
        if block.ref_cnt:
            return False
        if block.block_hash is not None:
            self.free_queue.push_cached(block_id)
        else:
            block.token_key = None
            self.free_queue.push_blank(block_id)
        return True

    def touch(self, block_id: int) -> None:
        """Move a free cached block to the most-recently-used end (replay of accesses)."""
        if self.blocks[block_id].ref_cnt == 0:
            self.free_queue.remove(block_id)
            self.free_queue.push_cached(block_id)

    # ---- prefix index --------------------------------------------------------------------------
    def register(self, block_id: int, block_hash: int, parent_hash: int, token_key: Hashable) -> None:
        """Publish a full block under its chained hash (first writer wins; a duplicate stays private)."""
        block = self.blocks[block_id]
        if block.block_hash is not None and block.token_key != token_key:
            self._notify(block.block_hash)  # an indexed block's tokens changed: lookups there may differ
        block.token_key = token_key
        if not self.enable_prefix_index or block.block_hash is not None:
            return
        if block_hash in self._index:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        self._index[block_hash] = block_id
        self._notify(block_hash)

    def forget(self, block_id: int) -> None:
        """Take the block out of the prefix index: its contents can no longer be trusted."""
        self._forget(self.blocks[block_id])

    def lookup(self, block_hash: int, parent_hash: int, token_key: Hashable) -> int | None:
        """The block holding exactly these tokens after exactly this parent, or None."""
        block_id = self._index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_key != token_key:
            return None  # hash collision: a miss, never a wrong context
        return block_id

    def watch(self, block_hash: int, watcher: Watcher) -> None:
        """Call ``watcher.invalidate()`` once, the next time what ``lookup`` finds at ``block_hash`` may change."""
        self._watchers.setdefault(block_hash, set()).add(watcher)

    def unwatch(self, block_hash: int, watcher: Watcher) -> None:
        ws = self._watchers.get(block_hash)
        if ws is not None:
            ws.discard(watcher)
            if not ws:
                del self._watchers[block_hash]

    def _notify(self, block_hash: int) -> None:
        if self._watchers:
            for w in self._watchers.pop(block_hash, ()):
                w.invalidate()

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            self._notify(block.block_hash)
            if self._index.get(block.block_hash) == block.block_id:
                del self._index[block.block_hash]
            block.block_hash = None
            block.parent_hash = NONE_HASH
        block.token_key = None

    def check_invariants(self) -> None:
        """free + held == pool; every free block has ref 0; the index points only at matching blocks."""
        held = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if held + len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"held {held} + free {len(self.free_queue)} != {self.num_blocks}")
        for b in self.blocks:
            if (b.ref_cnt == 0) != (b.block_id in self.free_queue):
                raise AssertionError(f"{b!r} free-queue membership disagrees with ref_cnt")
            if b.ref_cnt < 0:
                raise AssertionError(f"{b!r} has a negative ref_cnt")
        for h, i in self._index.items():
            if self.blocks[i].block_hash != h:
                raise AssertionError(f"index entry {h} -> {i} is stale")
