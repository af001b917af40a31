"""Session contexts over two tiers of blocks, with pins as leases and eviction in the hinted order.

One session's context, as logical blocks of ``block_size`` tokens::

    token_ids:  t0 ........................................................ tN   (computed at last use)
    logical:    [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ][ 7 ]
    device:     [d17][d3 ][d40][d8 ]                          block_ids      (resident prefix)
    host:                           [h2 ][h9 ]                host_block_ids (offloaded, next blocks)
    pinned:     [####][####]                                  the first pinned_blocks device blocks
                                              (blocks 6, 7 were dropped: their tokens recompute)

Eviction always takes a context's *last* resident block, so what stays is a prefix that a later prompt
can reuse.  A device block leaving goes to the host tier when one is configured (a real copy, queued as a
``CopyOp`` that the executor runs before the next forward pass), else it is dropped.  The session whose
blocks go first is chosen by the eviction policy (``_eviction.py``); pinned blocks and running or
waiting sessions are never chosen while a parked one is left.

Pins are leases: ``Pin(ttl_s)`` sets a deadline on this node's clock and covers the session's leading
device blocks up to the pin budget (``pin_budget_fraction`` of the pool, counted in distinct blocks, so
a shared prefix pinned twice costs once); a pin that does not fit is clamped and says so.  A lease that
nobody renews expires by itself; an admitted turn consumes its session's pin (the pause it bridged is
over), unless the orchestrator renews it at the next tool start.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum

from ._block_pool import NONE_HASH, Block, BlockPool, hash_block_tokens
from ._eviction import SessionHeap, get_eviction_policy
from ._executor import Clock, CopyOp

__all__ = ["KVCacheManager", "KVStats", "PinResult", "PlanMemo", "PrefixPlan", "Session", "SessionState"]


class SessionState(Enum):
    PARKED = "parked"
    WAITING = "waiting"
    RUNNING = "running"


@dataclass(eq=False)
class Session:
    session_id: str
    program_id: str
    created_s: float
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full logical block
    state: SessionState = SessionState.PARKED
    last_used_s: float = 0.0
    next_use_deadline_s: float | None = None
    pin_deadline_s: float | None = None
    pinned_blocks: int = 0
    pin_seq: int = 0
    prefetch_at_s: float | None = None
    priority_class: int = 0
    program_start_s: float | None = None  # from a Priority hint: program-level FCFS
    expected_output_tokens: int | None = None
    num_turns: int = 0
    released: bool = False
    # Bumped by the KV manager on every change to token_ids, block_ids, block_hashes or host_block_ids:
    # a PlanMemo's plan over them is stale once it moves.
    epoch: int = 0

    def __hash__(self) -> int:
        return id(self)

    @property
    def num_device_tokens(self) -> int:
        return min(len(self.token_ids), len(self.block_ids) * self._bs)

    @property
    def num_host_tokens(self) -> int:
        end = min(len(self.token_ids), (len(self.block_ids) + len(self.host_block_ids)) * self._bs)
        return max(0, end - self.num_device_tokens)

    _bs: int = 16


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


@dataclass
class PinResult:
    pinned_blocks: int
    requested_blocks: int
    deferred: bool = False  # the session is running or waiting: the pin applies when it parks

    @property
    def clamped(self) -> bool:
        return self.pinned_blocks < self.requested_blocks and not self.deferred


@dataclass
class KVStats:
    evicted_blocks: int = 0
    offloaded_blocks: int = 0
    reloaded_blocks: int = 0
    dropped_host_blocks: int = 0
    evicted_sessions: int = 0
    pin_expiries: int = 0
    pin_clamps: int = 0
    forced_unpins: int = 0
    prefetched_blocks: int = 0
    skipped_prefetches: int = 0  # due while a queued turn waited for memory (see _prefetch)


class KVCacheManager:
    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        clock: Clock,
        *,
        pin_budget_fraction: float = 0.5,
        eviction_policy: str = "hinted",
        retain_contexts: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= pin_budget_fraction < 1.0:
            raise ValueError(f"pin_budget_fraction must be in [0, 1), got {pin_budget_fraction}")
        self.block_size = block_size
        self.clock = clock
        self.device = BlockPool(num_device_blocks)
        self.host = BlockPool(num_host_blocks, enable_prefix_index=False)
        self.pin_budget_blocks = int(pin_budget_fraction * num_device_blocks)
        self.policy = get_eviction_policy(eviction_policy)
        # False reproduces vLLM: a finished request's blocks go straight to the free queue (LRU).
        self.retain_contexts = retain_contexts
        self.sessions: dict[str, Session] = {}
        self.programs: dict[str, set[str]] = {}
        self.pending_copies: list[CopyOp] = []
        self.stats = KVStats()
        self._pin_count = [0] * num_device_blocks
        self.num_pinned_blocks = 0
        self._device_evictable: SessionHeap[Session] = SessionHeap()
        self._host_holders: SessionHeap[Session] = SessionHeap()
        self._pin_expiry: list[tuple[float, int, str]] = []
        self._prefetch_due: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        # Only set_waiting makes a session WAITING, so every WAITING session is a key here: the queued
        # turns' contexts are found without a scan of every session this node ever held (a replay's
        # memory-bound steps looked for a waiting victim at every eviction).
        self._maybe_waiting: dict[Session, None] = {}
        self._creation_seq: dict[Session, int] = {}  # order of insertion into ``sessions``
        self._session_seq = itertools.count()

    # ---- sessions ----------------------------------------------------------------------------
    def get_or_create(self, session_id: str, program_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            now = self.clock.now()
            s = Session(session_id, program_id or session_id, created_s=now, last_used_s=now)
            s._bs = self.block_size
            self.sessions[session_id] = s
            self._creation_seq[s] = next(self._session_seq)
            self.programs.setdefault(s.program_id, set()).add(session_id)
        return s

    def _refresh(self, s: Session) -> None:
        """Keep the two eviction heaps in step with one session's state (call after every change)."""
        if s.state is SessionState.PARKED and len(s.block_ids) > s.pinned_blocks:
            self._device_evictable.set(s, self.policy.ref_time(s))
        else:
            self._device_evictable.discard(s)
        if s.host_block_ids:
            self._host_holders.set(s, self.policy.ref_time(s))
        else:
            self._host_holders.discard(s)

    # ---- prefix reuse (query, then mutate) -----------------------------------------------------
    def plan_prefix(self, s: Session, prompt: list[int], memo: PlanMemo | None = None) -> PrefixPlan:
        """What ``prompt`` can reuse of ``s``'s context and of the pool's prefix index (changes nothing).

        ``memo`` (one per queued request) returns the last plan again while nothing it read has changed
        (:class:`PlanMemo`); that plan is the memo's own object, which ``attach`` may update: only a plan
        that is about to be attached may be written to (attach changes the session, retiring the memo).
        """
        if memo is not None and (plan := memo.fresh_plan(s, prompt)) is not None:
            return plan
        walk = memo.fresh_walk(s, prompt) if memo is not None else None
        if walk is None:
            walk = self._walk_prefix(s, prompt)
            if memo is not None:
                memo.store_walk(s, prompt, walk, self.device)
        reads: list[tuple[Block, int, int | None]] = []
        plan = self._finish_plan(s, prompt, walk, reads)
        if memo is not None:
            memo.store_plan(plan, reads)
        return plan

    def _finish_plan(
        self, s: Session, prompt: list[int], walk: _PrefixWalk, reads: list[tuple[Block, int, int | None]]
    ) -> PrefixPlan:
        """The walk plus the session's partial tail block and host blocks, and the one-token rule; every
        pool block it looks at is noted in ``reads`` (for PlanMemo)."""
        bs = self.block_size
        blocks = self.device.blocks
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

    def _walk_prefix(self, s: Session, prompt: list[int]) -> _PrefixWalk:
        """The prompt's history in ``s`` and its leading full blocks found on the device (own or by hash)."""
        bs = self.block_size
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
            bid = self.device.lookup(h, parent, toks)
            probes.append((h, parent, toks, bid))
            if bid is None:
                break
            device.append((bid, j < len(s.block_ids) and s.block_ids[j] == bid))
            parent = h
            j += 1
        return _PrefixWalk(history, device, probes)

    def attach(self, s: Session, prompt: list[int], plan: PrefixPlan) -> bool:
        """Make ``plan`` the session's context: reuse hits, reload host hits, let go of the rest.

        False, with nothing changed, when the device cannot take the host part back right now: the host
        copy is kept for a later try (dropping it would turn a reload into a recompute).
        """
        for bid, own in plan.device:
            if not own:
                self.device.ref(bid)  # before allocating: an allocation must not evict our prefix hits
        dev: list[int] = []
        if plan.host:
            got = self.allocate_device(len(plan.host), exclude=s)
            if got is None:
                for bid, own in plan.device:
                    if not own:
                        self.device.unref(bid)
                return False
            dev = got
        # Pin counts follow block ids: let go here, re-grant on the new block list below while the lease
        # lasts.  The pin is consumed only when the turn is admitted (consume_pin): a turn that must wait
        # for memory keeps its context pinned, or the very load it waits behind would evict it.
        self._unpin(s)
        s.state = SessionState.RUNNING
        self._refresh(s)
        keep = {bid for bid, own in plan.device if own}
        for bid in s.block_ids:
            if bid not in keep:
                self.device.unref(bid)
        new_blocks = [bid for bid, _ in plan.device]
        cached = plan.num_cached_tokens
        reloaded_tokens = 0
        if dev:
            for hb, db in zip(plan.host, dev, strict=True):
                self.pending_copies.append(CopyOp("h2d", hb, db))
            new_blocks += dev
            reloaded_tokens = plan.num_host_tokens
            self.stats.reloaded_blocks += len(dev)
        for hb in s.host_block_ids:
            self.host.unref(hb)  # reloaded (copy already queued) or no longer part of the context
        s.host_block_ids = []
        total = cached + reloaded_tokens
        s.token_ids = prompt[:total]
        s.block_ids = new_blocks
        s.epoch += 1
        valid = min(len(s.block_hashes), total // self.block_size, plan.num_history_tokens // self.block_size)
        s.block_hashes = s.block_hashes[:valid]
        self._rehash(s)
        if s.pin_deadline_s is not None:  # a lease that ends while the turn waits holds until admission
            self._grant_pin(s)
        self._refresh(s)
        plan.num_host_tokens = reloaded_tokens
        return True

    def consume_pin(self, s: Session) -> None:
        """The session's turn was admitted: its pin has done its job."""
        self._unpin(s)
        s.pin_deadline_s = None
        self._refresh(s)

    def _rehash(self, s: Session) -> None:
        """Extend ``block_hashes`` over full blocks and publish them (first writer wins)."""
        bs = self.block_size
        parent = s.block_hashes[-1] if s.block_hashes else NONE_HASH
        for j in range(len(s.block_hashes), min(len(s.token_ids) // bs, len(s.block_ids))):
            toks = tuple(s.token_ids[j * bs : (j + 1) * bs])
            h = hash_block_tokens(parent, toks)
            self.device.register(s.block_ids[j], h, parent, toks)
            s.block_hashes.append(h)
            s.epoch += 1
            parent = h

    def ensure_slots(self, s: Session, num_tokens: int) -> bool:
        """Give a running session enough device blocks for ``num_tokens`` positions (evicting others)."""
        need = -(-num_tokens // self.block_size) - len(s.block_ids)
        if need <= 0:
            return True
        got = self.allocate_device(need, exclude=s)
        if got is None:
            return False
        s.block_ids.extend(got)
        s.epoch += 1
        return True

    def commit_tokens(self, s: Session, token_ids: list[int]) -> None:
        """The executor computed KV for these tokens (appended at the end of the context)."""
        s.token_ids.extend(token_ids)
        s.epoch += 1
        if len(s.token_ids) > len(s.block_ids) * self.block_size:
            raise RuntimeError(f"session {s.session_id}: KV written past its block table")
        self._rehash(s)

    def park(self, s: Session) -> None:
        """The session's request finished (or was preempted): its context waits for the next turn."""
        now = self.clock.now()
        s.state = SessionState.PARKED
        s.last_used_s = now
        if s.next_use_deadline_s is not None and s.next_use_deadline_s <= now:
            s.next_use_deadline_s = None  # the predicted use happened
        if s.released or not self.retain_contexts:
            self._drop_device(s, len(s.block_ids))
            if s.released:
                self.free_session(s)
                return
        elif s.pin_deadline_s is not None and s.pin_deadline_s > now:
            self._grant_pin(s)
        self._refresh(s)

    def set_waiting(self, s: Session) -> None:
        s.state = SessionState.WAITING
        self._maybe_waiting[s] = None
        self._refresh(s)

    # ---- allocation and eviction ---------------------------------------------------------------
    def allocate_device(self, n: int, exclude: Session | None = None) -> list[int] | None:
        now = self.clock.now()
        while self.device.num_free_blocks < n:
            victim = self._device_evictable.best(now)
            if victim is None:
                victim = self._waiting_victim(exclude)
            if victim is None:
                return None
            self._evict_one(victim)
        return self.device.allocate(n)

    def _waiting_sessions(self) -> list[Session]:
        """The sessions in ``sessions`` that are WAITING, in no particular order (prunes ``_maybe_waiting``)."""
        out = []
        for s in list(self._maybe_waiting):
            if s.state is SessionState.WAITING and self.sessions.get(s.session_id) is s:
                out.append(s)
            else:
                del self._maybe_waiting[s]  # (set_waiting puts it back when it waits again)
        return out

    def _waiting_victim(self, exclude: Session | None) -> Session | None:
        """Last resort before preempting a running request: the context of a queued turn."""
        # The largest order; among equals the session that came first in ``sessions``.
        def order(x: Session) -> tuple[int, float, int]:
            start = x.program_start_s if x.program_start_s is not None else x.created_s
            return (x.priority_class, start, -self._creation_seq.get(x, 0))

        best: Session | None = None
        for s in self._waiting_sessions():
            evictable = s is not exclude and len(s.block_ids) > s.pinned_blocks
            if evictable and (best is None or order(s) > order(best)):
                best = s
        return best

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

    def _drop_device(self, s: Session, n: int) -> None:
        self._unpin(s)
        self._drop_host(s, len(s.host_block_ids))
        for _ in range(min(n, len(s.block_ids))):
            self.device.unref(s.block_ids.pop())
        del s.block_hashes[len(s.block_ids) :]
        s.epoch += 1
        self._refresh(s)

    def free_session(self, s: Session) -> None:
        """Forget a session and everything it holds (Release, or a finished released program)."""
        self._drop_device(s, len(s.block_ids))
        self._device_evictable.discard(s)
        self._host_holders.discard(s)
        self.sessions.pop(s.session_id, None)
        self._creation_seq.pop(s, None)
        self._maybe_waiting.pop(s, None)
        members = self.programs.get(s.program_id)
        if members is not None:
            members.discard(s.session_id)
            if not members:
                del self.programs[s.program_id]

    def release_program(self, program_id: str) -> int:
        """Free every parked context of the program now; running ones are freed when they finish."""
        ids = list(self.programs.get(program_id, ()))
        for sid in ids:
            s = self.sessions[sid]
            s.released = True
            if s.state is SessionState.PARKED:
                self.free_session(s)
        return len(ids)

    # ---- pins ----------------------------------------------------------------------------------
    def set_pin(self, s: Session, ttl_s: float) -> PinResult:
        if ttl_s <= 0:
            self._unpin(s)
            s.pin_deadline_s = None
            self._refresh(s)
            return PinResult(0, 0)
        now = self.clock.now()
        s.pin_deadline_s = now + ttl_s
        s.pin_seq = next(self._seq)
        heapq.heappush(self._pin_expiry, (s.pin_deadline_s, s.pin_seq, s.session_id))
        if s.state is not SessionState.PARKED:
            return PinResult(0, len(s.block_ids), deferred=True)
        result = self._grant_pin(s)
        self._refresh(s)
        return result

    def _grant_pin(self, s: Session) -> PinResult:
        want = len(s.block_ids)
        j = s.pinned_blocks
        while j < want:
            bid = s.block_ids[j]
            if self._pin_count[bid] == 0:
                if self.num_pinned_blocks >= self.pin_budget_blocks:
                    break
                self.num_pinned_blocks += 1
            self._pin_count[bid] += 1
            j += 1
        s.pinned_blocks = j
        result = PinResult(j, want)
        if result.clamped:
            self.stats.pin_clamps += 1
        return result

    def _unpin(self, s: Session) -> None:
        for bid in s.block_ids[: s.pinned_blocks]:
            self._pin_count[bid] -= 1
            if self._pin_count[bid] == 0:
                self.num_pinned_blocks -= 1
        s.pinned_blocks = 0

    def force_unpin_latest(self) -> bool:
        """Deadlock rule: pinned memory blocks all progress, so the latest-arriving program lets go."""
        pinned = [s for s in self.sessions.values() if s.pinned_blocks]
        if not pinned:
            return False
        s = max(pinned, key=lambda x: (x.program_start_s or x.created_s, x.created_s))
        self._unpin(s)
        s.pin_deadline_s = None
        self.stats.forced_unpins += 1
        self._refresh(s)
        return True

    # ---- hints that only move predictions ------------------------------------------------------
    def set_next_use(self, s: Session, next_use_s: float) -> None:
        s.next_use_deadline_s = self.clock.now() + next_use_s
        self._refresh(s)

    def set_prefetch(self, s: Session, at_s: float) -> None:
        s.prefetch_at_s = self.clock.now() + at_s
        heapq.heappush(self._prefetch_due, (s.prefetch_at_s, next(self._seq), s.session_id))
        self.set_next_use(s, at_s)

    # ---- time passes ---------------------------------------------------------------------------
    def tick(self) -> bool:
        """Expire pin leases and run due prefetches; cheap when nothing is due. True if anything changed."""
        now = self.clock.now()
        changed = False
        while self._pin_expiry and self._pin_expiry[0][0] <= now:
            _, seq, sid = heapq.heappop(self._pin_expiry)
            s = self.sessions.get(sid)
            if s is None or s.pin_seq != seq or s.pin_deadline_s is None:
                continue
            if s.state is SessionState.WAITING:
                continue  # its next turn is queued: the pin is consumed at admission instead
            self._unpin(s)
            s.pin_deadline_s = None
            self.stats.pin_expiries += 1
            self._refresh(s)
            changed = True
        while self._prefetch_due and self._prefetch_due[0][0] <= now:
            _, _, sid = heapq.heappop(self._prefetch_due)
            s = self.sessions.get(sid)
            if s is not None and s.state is SessionState.PARKED and s.host_block_ids:
                self._prefetch(s)
                changed = True
        return changed

    def _prefetch(self, s: Session) -> None:
        """Reload host blocks into *free* device blocks only: a prefetch never evicts anyone.

        Nor does it take free blocks while a queued turn waits for memory: that turn would have to evict
        (offload) someone to get back the very blocks the prefetch took, so a guess about a future turn
        would cost a turn that is ready now (measured in replay: about 70% more offloads, a longer queue).
        The prefetch is dropped; the session's turn reloads its host blocks on admission instead.
        """
        if self._waiting_sessions():
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

    # ---- accounting ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.host.check_invariants()
        dev_refs = [0] * self.device.num_blocks
        host_refs = [0] * self.host.num_blocks
        pins = [0] * self.device.num_blocks
        for s in self.sessions.values():
            for bid in s.block_ids:
                dev_refs[bid] += 1
            for hb in s.host_block_ids:
                host_refs[hb] += 1
            for bid in s.block_ids[: s.pinned_blocks]:
                pins[bid] += 1
            if s.pinned_blocks > len(s.block_ids):
                raise AssertionError(f"{s.session_id}: pins past its blocks")
        for b in self.device.blocks:
            if b.ref_cnt != dev_refs[b.block_id]:
                raise AssertionError(f"device {b!r}: ref_cnt != {dev_refs[b.block_id]} session references")
        for b in self.host.blocks:
            if b.ref_cnt != host_refs[b.block_id]:
                raise AssertionError(f"host {b!r}: ref_cnt != {host_refs[b.block_id]} session references")
        if pins != self._pin_count or sum(1 for p in pins if p) != self.num_pinned_blocks:
            raise AssertionError("pin counts disagree with sessions")
        if self.num_pinned_blocks > max(self.pin_budget_blocks, 0):
            raise AssertionError("pinned blocks over budget")


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

