"""Which waiting turns are warm on the vLLM node: how much of a queued prompt is still cached.

A warm turn (``engine_adapter._queue_place.is_warm``) goes ahead of cold ones of its class, in band 1
after pinned turns (``QueueRules._sync_pinned_band`` re-keys it each step). Why: under vLLM's FCFS a resumed turn whose context
survived its tool pause waits behind cold prompts, and while it waits its unpinned blocks sit in the LRU
free queue; on a short pool they are evicted before it runs and the turn re-prefills its whole history
(stock vLLM with a host tier of half the pool, trace B: hits 16% while the host tier saved 1,100 blocks
every 10 s and loaded 40). Served first, it costs the few hundred tokens it adds.

How much is cached, without touching vLLM's prefix-cache statistics (``get_computed_blocks`` counts a
query as a hit or a miss) and in O(log n) per request, since the classification runs every step for every
waiting turn: the device keeps a context as a prefix (vLLM frees a request's blocks tail first, so the
tail is evicted first), and so does the host tier (``HostIndex.touch_chain``: tail first), so each tier's
run ends where a bisection over the prompt's block hashes finds it. A run with a hole (a block of a shared
prefix evicted out of order) can only make a turn look warmer than it is: vLLM's own lookup then finds
less and the turn computes more; nothing is lost or double-counted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

__all__ = ["num_cached_tokens"]


def _run_end(hashes: Sequence[Hashable], start: int, has: Callable[[Hashable], bool]) -> int:
    """The end of the run of ``hashes[start:]`` that ``has``, taking it as a prefix (bisection)."""
    if start >= len(hashes) or not has(hashes[start]):
        return start  # (a run that does not begin here is none: the bisection would find its end anyway)
    lo, hi = start + 1, len(hashes)  # hashes[start:lo] are held; hashes[hi:] are not
    while lo < hi:
        mid = (lo + hi) // 2
        if has(hashes[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


def num_cached_tokens(
    block_hashes: Sequence[Hashable],
    num_prompt_tokens: int,
    block_size: int,
    on_device: Callable[[Hashable], bool],
    on_host: Callable[[Hashable], bool] | None = None,
) -> int:
    """Prompt tokens a waiting request would find cached: the device's run of its full blocks, then the
    host tier's run after it (``on_host`` None: no host tier). The last prompt token is always computed."""
    usable = min(len(block_hashes), max(0, num_prompt_tokens - 1) // block_size)
    hashes = block_hashes[:usable]
    end = _run_end(hashes, 0, on_device)
    if on_host is not None and end < usable:
        end = _run_end(hashes, end, on_host)
    return end * block_size
