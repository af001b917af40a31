"""What a prompt can reuse of its session's context and of the device pool's prefix index, and the memo
that keeps one queued request's last answer while nothing it read has changed.

Why apart from ``_kv_manager``: planning only reads (the session, the pool's prefix index and a few
blocks); ``KVCacheManager.attach`` is what applies a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._block_pool import NONE_HASH, Block, BlockPool, hash_block_tokens
from ._session import Session

__all__ = ["PlanMemo", "PrefixPlan", "plan_prefix"]


@dataclass
class PrefixPlan:
    """What a prompt can reuse; computed without changing anything (query), applied by ``attach``."""

    device: list[tuple[int, bool]]  # (block id, is the session's own block) for each hit block
    host: list[int]  # session host blocks to reload, in logical order after the device hits
    num_cached_tokens: int  # device hits, in tokens
    num_host_tokens: int  # host hits, in tokens
    num_history_tokens: int  # tokens of this prompt that the session computed in an earlier turn

    @property
    def num_hit_tokens(self) -> int:
        return self.num_cached_tokens + self.num_host_tokens


@dataclass(slots=True)
class _PrefixWalk:
    """The costly part of a plan: history length, device hits over full blocks, and the pool lookups made
    (hash, parent, tokens, answer), in walk order; the last one is the miss that ended the walk, if any."""

    history: int
    device: list[tuple[int, bool]]
    probes: list[tuple[int, int, tuple[int, ...], int | None]]


class PlanMemo:
    """One prompt's last prefix plan, kept across ``plan_prefix`` calls while nothing it read has changed.

    The scheduler re-plans every queued request each time a step looks at it (the queue ahead, memory and
    the step budget all move), and a plan compares the whole prompt with the session's tokens and hashes
    every block past the session's own: most of a replay's time with a long queue.  A plan reads only

    * the prompt: a memo belongs to one request, whose tokens only grow (prompt, then output appended), so
      the same length means the same tokens;
    * the session's ``token_ids``, ``block_ids``, ``block_hashes`` and ``host_block_ids``: the same list
      objects (``EngineCore.import_context`` replaces them) with the same ``epoch`` (the KV manager bumps
      it on every change it makes to them) are the same contents;
    * the pool's answers to its ``lookup`` calls: given the session and the prompt, the walk over full
      blocks is decided by those answers alone, and the pool calls ``invalidate`` the first time the answer
      at any hash it was asked about may change (``BlockPool.watch``);
    * ``ref_cnt`` and ``block_hash`` of the few own blocks the tail rules looked at, kept and compared.

    So a memo that passes these checks holds exactly the plan a fresh call would compute.  ``release`` it
    when its request leaves the queue (the pool holds it in its watch lists until then).
    """

    __slots__ = (
        "_block_hashes", "_block_ids", "_epoch", "_host_block_ids", "_len", "_pool", "_reads", "_session",
        "_token_ids", "_watched", "plan", "walk",
    )

    def __init__(self) -> None:
        self.walk: _PrefixWalk | None = None  # the walk over full blocks (the costly part)
        self.plan: PrefixPlan | None = None  # the whole plan built on it
        self._reads: list[tuple[Block, int, int | None]] = []  # (block, ref_cnt, block_hash) the plan read
        self._pool: BlockPool | None = None  # where the walk's probes are watched
        self._watched: list[int] = []  # their hashes (still listed there after an invalidate)
        self._session: Session | None = None
        self._len = -1
        self._epoch = -1
        # the session's lists the plan read (compared by identity)
        self._token_ids: list[int] | None = None
        self._block_ids: list[int] | None = None
        self._block_hashes: list[int] | None = None
        self._host_block_ids: list[int] | None = None

    def fresh_walk(self, s: Session, prompt: list[int]) -> _PrefixWalk | None:
        if (
            self.walk is None
            or self._session is not s
            or self._len != len(prompt)
            or self._epoch != s.epoch
            or self._token_ids is not s.token_ids
            or self._block_ids is not s.block_ids
            or self._block_hashes is not s.block_hashes
            or self._host_block_ids is not s.host_block_ids
        ):
            return None
        return self.walk

    def fresh_plan(self, s: Session, prompt: list[int]) -> PrefixPlan | None:
        """The kept plan if it is still what ``plan_prefix`` would compute, else None."""
        if (  # (fresh_walk's checks, inline: the scheduler asks this for every queued request at every step)
            self.plan is None
            or self._epoch != s.epoch
            or self._session is not s
            or self._len != len(prompt)
            or self._token_ids is not s.token_ids
            or self._block_ids is not s.block_ids
            or self._block_hashes is not s.block_hashes
            or self._host_block_ids is not s.host_block_ids
        ):
            return None
        for block, ref_cnt, block_hash in self._reads:
            if block.ref_cnt != ref_cnt or block.block_hash != block_hash:
                return None
        return self.plan

    def store_walk(self, s: Session, prompt: list[int], walk: _PrefixWalk, pool: BlockPool) -> None:
        self.release()
        self.walk, self._pool = walk, pool
        self._session, self._len, self._epoch = s, len(prompt), s.epoch
        self._token_ids, self._block_ids = s.token_ids, s.block_ids
        self._block_hashes, self._host_block_ids = s.block_hashes, s.host_block_ids
        self._watched = [h for h, _, _, _ in walk.probes]
        for h in self._watched:
            pool.watch(h, self)

    def store_plan(self, plan: PrefixPlan, reads: list[tuple[Block, int, int | None]]) -> None:
        self.plan, self._reads = plan, reads

    def invalidate(self) -> None:
        """A lookup the walk made may now answer differently (called by the pool)."""
        self.walk = self.plan = None

    def release(self) -> None:
        """Forget everything and leave the pool's watch lists."""
        if self._pool is not None:
            for h in self._watched:
                self._pool.unwatch(h, self)
        self.walk = self.plan = self._pool = self._session = None
        self._reads, self._watched = [], []


def plan_prefix(
    pool: BlockPool, block_size: int, s: Session, prompt: list[int], memo: PlanMemo | None = None
) -> PrefixPlan:
    """What ``prompt`` can reuse of ``s``'s context and of the pool's prefix index (changes nothing).

    ``memo`` (one per queued request) returns the last plan again while nothing it read has changed
    (:class:`PlanMemo`); that plan is the memo's own object, which ``attach`` may update: only a plan
    that is about to be attached may be written to (attach changes the session, retiring the memo).
    """
    if memo is not None and (plan := memo.fresh_plan(s, prompt)) is not None:
        return plan
    walk = memo.fresh_walk(s, prompt) if memo is not None else None
    if walk is None:
        walk = _walk_prefix(pool, block_size, s, prompt)
        if memo is not None:
            memo.store_walk(s, prompt, walk, pool)
    reads: list[tuple[Block, int, int | None]] = []
    plan = _finish_plan(pool, block_size, s, prompt, walk, reads)
    if memo is not None:
        memo.store_plan(plan, reads)
    return plan


def _finish_plan(
    pool: BlockPool,
    block_size: int,
    s: Session,
    prompt: list[int],
    walk: _PrefixWalk,
    reads: list[tuple[Block, int, int | None]],
) -> PrefixPlan:
    """The walk plus the session's partial tail block and host blocks, and the one-token rule; every
    pool block it looks at is noted in ``reads`` (for PlanMemo)."""
    bs = block_size
    blocks = pool.blocks
    history = walk.history
    device = list(walk.device)  # (trimmed below: the walk may be reused)
    j = len(device)
    host: list[int] = []
    cached = j * bs
    # The session's own partial tail block is reused in place when nobody else holds it.
    if j == len(s.block_ids) - 1 and j * bs < history:
        tail = blocks[s.block_ids[j]]
        reads.append((tail, tail.ref_cnt, tail.block_hash))
        if tail.ref_cnt == 1 and tail.block_hash is None:
            device.append((s.block_ids[j], True))
            cached = min(history, s.num_device_tokens)
    host_tokens = 0
    k = len(s.block_ids)
    if cached == len(device) * bs and len(device) >= k:
        for i, hb in enumerate(s.host_block_ids):
            logical = k + i
            if logical < len(device):
                continue  # that block was still cached on the device: its host copy is not needed
            if logical * bs >= history:
                break
            host.append(hb)
            host_tokens = min(history, (logical + 1) * bs) - cached
    # At least one prompt token is computed, for its logits.
    while cached + host_tokens >= len(prompt) and (device or host):
        if host:
            host.pop()
            host_tokens = max(0, min(history, (len(device) + len(host)) * bs) - cached)
        elif device[-1][1] and _read(blocks[device[-1][0]], reads).block_hash is None:
            cached = len(prompt) - 1  # own partial block: recompute just the last token in place
            break
        else:
            device.pop()
            cached = len(device) * bs
    return PrefixPlan(device, host, cached, host_tokens, history)


def _walk_prefix(pool: BlockPool, block_size: int, s: Session, prompt: list[int]) -> _PrefixWalk:
    """The prompt's history in ``s`` and its leading full blocks found on the device (own or by hash)."""
    bs = block_size
    hist = s.token_ids
    n = min(len(prompt), len(hist))
    history = n if prompt[:n] == hist[:n] else _common_prefix_len(prompt, hist, n)
    device: list[tuple[int, bool]] = []
    probes: list[tuple[int, int, tuple[int, ...], int | None]] = []
    parent = NONE_HASH
    n_full = len(prompt) // bs
    j = 0
    own_full = min(history // bs, len(s.block_hashes))
    while j < n_full:
        if j < own_full and j < len(s.block_ids):
            device.append((s.block_ids[j], True))
            parent = s.block_hashes[j]
            j += 1
            continue
        toks = tuple(prompt[j * bs : (j + 1) * bs])
        h = s.block_hashes[j] if j < own_full else hash_block_tokens(parent, toks)
        bid = pool.lookup(h, parent, toks)
        probes.append((h, parent, toks, bid))
        if bid is None:
            break
        device.append((bid, j < len(s.block_ids) and s.block_ids[j] == bid))
        parent = h
        j += 1
    return _PrefixWalk(history, device, probes)


def _read(block: Block, reads: list[tuple[Block, int, int | None]]) -> Block:
    reads.append((block, block.ref_cnt, block.block_hash))
    return block


def _common_prefix_len(a: list[int], b: list[int], n: int) -> int:
    lo, hi = 0, n  # binary search on list-slice equality: C-speed compares, O(n log n) worst case
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
