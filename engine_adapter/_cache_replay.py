"""Replay a Mooncake-format request trace through the real paged ``BlockPool`` to measure prefix-cache hit rates.

For each capacity the trace is replayed twice, once with an LRU free queue and once with Belady's order
(evict the cached block whose next use lies furthest ahead), plus once against an unbounded cache.

Rules:

* A request's prompt is the trace's ``hash_ids``, one per ``block_size``-token block, chained from the start.
  Every block holds ``block_size`` tokens except the last, which holds ``input_length - block_size*(n-1)``
  (clamped into ``[1, block_size]`` when the line is inconsistent; tokens past the last id never hit).
* Hit rate = tokens of the longest cached prefix of each request / all input tokens.
* Requests are replayed in file order, timestamps ignored.  After a request's lookup every one of its blocks
  is touched (a cached one is re-referenced, also past the first miss) or inserted, one at a time, evicting
  the free queue's head when no blank block is left; a request larger than the pool inserts what fits.
  Then the request releases its blocks, last block first, so a chain's tail is reused before its root.
* Belady's key for a block is the index of the next request whose prompt contains the same chained prefix
  (the same block identity the pool verifies), infinity if none; it is computed in one backward pass.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine_adapter._block_pool import NONE_HASH, BlockPool, KeyedFreeQueue, LRUFreeQueue, hash_block_tokens

__all__ = ["replay_mooncake"]

_INF = math.inf
_PROGRESS_CHUNK = 256  # requests per progress-bar update


@dataclass(slots=True)
class _Request:
    hashes: list[int]  # chained block hash per block
    keys: list[tuple[int, int]]  # (hash_id, tokens in block): what the pool verifies a hit against
    ntoks: list[int]  # tokens per block
    input_tokens: int  # all input tokens, including any past the last block
    next_use: list[float]  # per block: index of the next request holding the same chained block, or inf


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def _load_trace(
    path: str | os.PathLike[str], block_size: int, limit: int | None
) -> tuple[list[_Request], int]:
    """Parse and validate the trace; returns the requests and how many lines needed clamping."""
    requests: list[_Request] = []
    clamped = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _bad(where, f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise _bad(where, f"expected a JSON object, got {type(rec).__name__}")
            input_length = rec.get("input_length")
            hash_ids = rec.get("hash_ids")
            if input_length is None:
                raise _bad(where, "missing 'input_length'")
            if hash_ids is None:
                raise _bad(where, "missing 'hash_ids'")
            if type(input_length) is not int or input_length < 0:
                raise _bad(where, f"'input_length' must be a non-negative integer, got {input_length!r}")
            if not isinstance(hash_ids, list) or any(type(h) is not int for h in hash_ids):
                raise _bad(where, "'hash_ids' must be a list of integers")

            n = len(hash_ids)
            if n == 0:
                if input_length:
                    clamped += 1
                requests.append(_Request([], [], [], input_length, []))
                continue
            last = input_length - block_size * (n - 1)
            if not 1 <= last <= block_size:
                clamped += 1
            last = min(max(last, 1), block_size)
            covered = block_size * (n - 1) + last
            ntoks = [block_size] * (n - 1) + [last]
            keys = list(zip(hash_ids, ntoks, strict=True))
            hashes = []
            parent = NONE_HASH
            for key in keys:
                parent = hash_block_tokens(parent, key)
                hashes.append(parent)
            requests.append(_Request(hashes, keys, ntoks, max(input_length, covered), []))

    # One backward pass: the next request index that holds each chained block.
    seen: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        req = requests[i]
        req.next_use = [seen.get(h, _INF) for h in req.hashes]
        for h in req.hashes:
            seen[h] = i
    return requests, clamped


def _replay_infinite(requests: list[_Request], tick: Callable[[int], object]) -> int:
    cached: set[int] = set()
    hit = 0
    for i, req in enumerate(requests):
        for h, n in zip(req.hashes, req.ntoks, strict=True):
            if h not in cached:
                break
            hit += n
        cached.update(req.hashes)
        if i % _PROGRESS_CHUNK == _PROGRESS_CHUNK - 1:
            tick(_PROGRESS_CHUNK)
    tick(len(requests) % _PROGRESS_CHUNK)
    return hit


def _replay_pool(
    requests: list[_Request], num_blocks: int, belady: bool, tick: Callable[[int], object]
) -> int:
    next_use = [_INF] * num_blocks  # per pool block: the key Belady's queue reads when the block is freed
    queue = KeyedFreeQueue(next_use.__getitem__) if belady else LRUFreeQueue()
    pool = BlockPool(num_blocks, free_queue=queue)
    lookup, ref, unref, allocate, register = pool.lookup, pool.ref, pool.unref, pool.allocate, pool.register
    hit = 0
    for i, req in enumerate(requests):
        held: list[int] = []
        held_next: list[float] = []
        in_prefix = True
        parent = NONE_HASH
        for h, key, n, nxt in zip(req.hashes, req.keys, req.ntoks, req.next_use, strict=True):
            bid = lookup(h, parent, key)
            if bid is not None:
                ref(bid)
                if in_prefix:
                    hit += n
            else:
                in_prefix = False
                if len(queue) == 0:  # the request already holds the whole pool: insert no more
                    break
                bid = allocate(1)[0]
                register(bid, h, parent, key)
            held.append(bid)
            held_next.append(nxt)
            parent = h
        for bid, nxt in zip(reversed(held), reversed(held_next), strict=True):
            next_use[bid] = nxt
            unref(bid)
        if i % _PROGRESS_CHUNK == _PROGRESS_CHUNK - 1:
            tick(_PROGRESS_CHUNK)
    tick(len(requests) % _PROGRESS_CHUNK)
    pool.check_invariants()
    return hit


def replay_mooncake(
    path: str | os.PathLike[str],
    capacities_tokens: Iterable[int],
    block_size: int = 512,
    limit: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Replay a Mooncake trace at each KV capacity (in tokens) with LRU and Belady eviction.

    Returns ``{"trace", "num_requests", "input_tokens", "infinite_hit_rate", "clamped_requests",
    "capacities": [{"capacity_tokens", "num_blocks", "lru_hit_rate", "belady_hit_rate"}, ...]}``.
    Raises ``ValueError`` for a non-positive capacity, block size or a negative limit, and
    ``ValueError("TRACE:LINE: what is wrong")`` for a malformed trace line.
    """
    caps = list(capacities_tokens)
    for c in caps:
        if type(c) is not int or c <= 0:
            raise ValueError(f"capacity must be a positive integer number of tokens, got {c!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit!r}")

    requests, clamped = _load_trace(path, block_size, limit)
    input_tokens = sum(r.input_tokens for r in requests)

    def rate(hit: int) -> float:
        return hit / input_tokens if input_tokens else 0.0

    bar = None
    tick: Callable[[int], object] = lambda n: None  # noqa: E731
    if progress:
        from tqdm import tqdm

        runs = 1 + 2 * len(caps)  # infinite, then LRU and Belady per capacity
        bar = tqdm(total=len(requests) * runs, unit="req", desc="cache-replay", leave=False)
        tick = bar.update
    try:
        infinite = rate(_replay_infinite(requests, tick))
        rows = []
        for cap in caps:
            num_blocks = cap // block_size
            rows.append(
                {
                    "capacity_tokens": cap,
                    "num_blocks": num_blocks,
                    "lru_hit_rate": rate(_replay_pool(requests, num_blocks, False, tick)),
                    "belady_hit_rate": rate(_replay_pool(requests, num_blocks, True, tick)),
                }
            )
    finally:
        if bar is not None:
            bar.close()
    return {
        "trace": str(path),
        "num_requests": len(requests),
        "input_tokens": input_tokens,
        "infinite_hit_rate": infinite,
        "clamped_requests": clamped,
        "capacities": rows,
    }
