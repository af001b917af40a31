"""Hinted eviction order on vLLM's free block queue.

vLLM evicts from the front of ``BlockPool.free_block_queue``, a linked list ordered by when blocks were
freed (LRU). That order is a prediction too: the context freed longest ago is assumed to be needed last.
An ``EvictionOrder`` hint replaces that guess for the contexts it names. The queue has no keyed insert,
only its two ends (``prepend_n``, ``append_n``) and ``remove``, so a hinted context goes to one end:

- next use further than :data:`FAR_USE_S` away: the front, evicted before any unhinted block;
- nearer: the tail, evicted last;
- among hinted contexts at the same end, the larger next use is evicted first; within a context, its
  last block first, so what stays is a prefix a later prompt can reuse (vLLM's own rule).

Only free blocks (``ref_cnt == 0``) whose hash is still the one the context computed are moved; a block
shared by two contexts moves once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FAR_USE_S", "Block", "place_by_next_use"]

Block = Any
"""A ``vllm.v1.core.kv_cache_utils.KVCacheBlock``: ``block_id``, ``block_hash``, ``ref_cnt``, ``is_null``."""

FAR_USE_S = 10.0
"""Seconds: a predicted next use further away than this sends the context to the front of the queue."""


def place_by_next_use(queue: Any, contexts: Sequence[tuple[float, Sequence[tuple[Block, Any]]]]) -> int:
    """Move each context's free, still-cached blocks by its remaining next use (seconds; ``inf``: never).

    ``contexts`` holds (seconds until next use, [(block, hash it had when its turn ended), ...] in
    logical order). Returns the number of blocks moved.
    """
    taken: set[int] = set()
    segments: list[tuple[bool, list[Block]]] = []
    for next_use_s, snapshot in sorted(contexts, key=lambda c: c[0]):
        free = [b for b, h in snapshot if b.block_hash == h and b.ref_cnt == 0 and b.block_id not in taken]
        taken.update(b.block_id for b in free)
        for b in free:
            queue.remove(b)
        segments.append((next_use_s > FAR_USE_S, free[::-1]))  # last block first
    for far, blocks in segments:  # ascending next use: each prepend lands in front of the previous one
        if far:
            queue.prepend_n(blocks)
    for far, blocks in reversed(segments):  # descending: the nearest ends up at the very tail
        if not far:
            queue.append_n(blocks)
    return len(taken)
