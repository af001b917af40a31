"""Block pool, pin leases, eviction order, pin budget and host tier of the KV manager."""

from __future__ import annotations

import pytest

from engine_adapter import BlockPool, KeyedFreeQueue, KVCacheManager, Session, VirtualClock, hash_block_tokens
from engine_adapter._eviction import SessionHeap, predicted_next_use

BS = 4


# ---- block pool --------------------------------------------------------------------------------
def test_pool_allocate_free_and_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    for b in a:
        assert pool.unref(b)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="free block"):
        pool.unref(a[0])
    pool.check_invariants()


def test_prefix_hit_is_verified_against_tokens_not_hash() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    toks = (1, 2, 3, 4)
    h = hash_block_tokens(0, toks)
    pool.register(b, h, 0, toks)
    assert pool.lookup(h, 0, toks) == b
    # The same hash with other tokens (a collision) or another parent is a miss, never a wrong context.
    assert pool.lookup(h, 0, (9, 9, 9, 9)) is None
    assert pool.lookup(h, 12345, toks) is None


def test_lru_free_queue_reuses_blank_blocks_before_cached_ones() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, 11, 0, (1,))
    pool.unref(a)  # cached: tail
    pool.unref(b)  # blank: head
    assert pool.allocate(1) == [b]
    assert pool.lookup(11, 0, (1,)) == a  # the cached prefix survived
    pool.unref(c)
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]  # only now is the cached block overwritten
    assert pool.lookup(11, 0, (1,)) is None


def test_keyed_free_queue_evicts_largest_key_first() -> None:
    keys = {0: 5.0, 1: 50.0, 2: 10.0}
    pool = BlockPool(3, free_queue=KeyedFreeQueue(lambda i: keys[i]))
    blocks = pool.allocate(3)
    for i in blocks:
        pool.register(i, 100 + i, 0, (i,))
        pool.unref(i)
    assert [pool.allocate(1)[0] for _ in range(3)] == [1, 2, 0]


# ---- eviction scale ----------------------------------------------------------------------------
def test_session_heap_orders_by_predicted_next_use() -> None:
    heap: SessionHeap[str] = SessionHeap()
    now = 100.0
    heap.set("hinted-in-40s", 140.0)
    heap.set("idle-60s", 40.0)  # predicted next use: now + 60
    heap.set("idle-10s", 90.0)
    assert predicted_next_use(40.0, now) == 160.0
    assert heap.best(now) == "idle-60s"
    heap.discard("idle-60s")
    assert heap.best(now) == "hinted-in-40s"
    heap.set("hinted-in-40s", 95.0)  # re-hinted: overdue by 5 s -> next use 105
    assert heap.best(now) == "idle-10s"


def make_kv(num_blocks: int = 16, host: int = 0, **kw: object) -> tuple[KVCacheManager, VirtualClock]:
    clock = VirtualClock()
    return KVCacheManager(num_blocks, host, BS, clock, **kw), clock  # type: ignore[arg-type]


def park_context(kv: KVCacheManager, sid: str, tokens: list[int], program: str | None = None) -> Session:
    """Give a session a computed context of ``tokens`` and park it (what a finished turn leaves)."""
    s = kv.get_or_create(sid, program or sid)
    plan = kv.plan_prefix(s, tokens)
    kv.attach(s, tokens, plan)
    assert kv.ensure_slots(s, len(tokens))
    kv.commit_tokens(s, tokens[len(s.token_ids) :])
    kv.park(s)
    return s


def take(kv: KVCacheManager, n: int) -> bool:
    """Allocate n blocks as some new request would, then hand them back: evictions are what remains."""
    got = kv.allocate_device(n)
    if got is None:
        return False
    for b in got:
        kv.device.unref(b)
    return True


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_eviction_follows_hinted_next_use_largest_first() -> None:
    kv, _ = make_kv(12)
    a = park_context(kv, "a", toks(0, 16))  # 4 blocks each
    b = park_context(kv, "b", toks(100, 16))
    c = park_context(kv, "c", toks(200, 16))
    kv.set_next_use(a, 10.0)
    kv.set_next_use(b, 100.0)
    kv.set_next_use(c, 50.0)
    held = kv.allocate_device(4)
    assert held is not None
    assert (len(a.block_ids), len(b.block_ids), len(c.block_ids)) == (4, 0, 4)
    more = kv.allocate_device(2)
    assert more is not None
    assert (len(a.block_ids), len(c.block_ids)) == (4, 2)  # tail first: c keeps its prefix
    for blk in held + more:
        kv.device.unref(blk)
    kv.check_invariants()


def test_an_allocation_that_cannot_succeed_evicts_nothing() -> None:
    """Query, then mutate: when even evicting every parked context (pins excepted) could not free enough,
    the allocation fails at once and every context stays where it is; with enough, it evicts as before."""
    kv, _ = make_kv(12)
    a = park_context(kv, "a", toks(0, 16))  # 4 blocks each, 8 of 12 used
    b = park_context(kv, "b", toks(100, 16))
    assert kv.set_pin(a, 60.0).pinned_blocks == 4
    assert kv.num_evictable_blocks == 4  # b's; a's are pinned
    held = kv.allocate_device(4)  # the 4 free ones
    assert held is not None and kv.device.num_free_blocks == 0
    assert kv.allocate_device(5) is None  # 0 free + 4 evictable < 5
    assert (len(a.block_ids), len(b.block_ids), kv.stats.evicted_blocks) == (4, 4, 0)
    more = kv.allocate_device(4)  # exactly what evicting b frees
    assert more is not None and len(b.block_ids) == 0 and kv.stats.evicted_blocks == 4
    assert kv.num_evictable_blocks == 0
    for blk in held + more:
        kv.device.unref(blk)
    kv.check_invariants()


def test_unhinted_context_is_ranked_by_recency_on_the_same_scale() -> None:
    kv, clock = make_kv(8)
    old = park_context(kv, "old", toks(0, 16))
    clock.advance(60.0)
    hinted = park_context(kv, "hinted", toks(100, 16))
    kv.set_next_use(hinted, 40.0)  # needed in 40 s; "old" has idled 60 s -> expected in 60 s
    assert take(kv, 4)
    assert len(old.block_ids) == 0 and len(hinted.block_ids) == 4


def test_lru_policy_ignores_hints() -> None:
    kv, clock = make_kv(8, eviction_policy="lru")
    a = park_context(kv, "a", toks(0, 16))
    clock.advance(1.0)
    b = park_context(kv, "b", toks(100, 16))
    kv.set_next_use(a, 0.0)
    kv.set_next_use(b, 1000.0)
    assert take(kv, 4)
    assert len(a.block_ids) == 0 and len(b.block_ids) == 4


def test_pin_keeps_context_until_lease_expires_on_node_clock() -> None:
    kv, clock = make_kv(8, pin_budget_fraction=0.5)
    a = park_context(kv, "a", toks(0, 16))
    r = kv.set_pin(a, 5.0)
    assert (r.pinned_blocks, r.clamped) == (4, False)
    assert kv.num_pinned_blocks == 4
    b = park_context(kv, "b", toks(100, 16))
    held = kv.allocate_device(4)  # takes b, not the pinned a
    assert held is not None
    assert len(a.block_ids) == 4 and len(b.block_ids) == 0
    assert kv.allocate_device(1) is None  # only pinned memory is left
    clock.advance(5.01)
    kv.tick()
    assert kv.num_pinned_blocks == 0 and kv.stats.pin_expiries == 1
    more = kv.allocate_device(4)
    assert more is not None and len(a.block_ids) == 0
    for blk in held + more:
        kv.device.unref(blk)
    kv.check_invariants()


def test_pin_over_budget_is_clamped_and_reported() -> None:
    kv, _ = make_kv(16, pin_budget_fraction=0.25)  # 4 blocks of budget
    a = park_context(kv, "a", toks(0, 12))  # 3 blocks
    b = park_context(kv, "b", toks(100, 12))
    assert not kv.set_pin(a, 10).clamped
    r = kv.set_pin(b, 10)
    assert r.clamped and (r.pinned_blocks, r.requested_blocks) == (1, 3)
    assert kv.num_pinned_blocks == 4 and kv.stats.pin_clamps == 1
    kv.check_invariants()


def test_shared_prefix_pinned_by_two_sessions_counts_once() -> None:
    kv, _ = make_kv(16, pin_budget_fraction=0.5)
    shared = toks(0, 8)
    a = park_context(kv, "a", shared + toks(50, 4))
    b = park_context(kv, "b", shared + toks(60, 4))
    assert a.block_ids[:2] == b.block_ids[:2]  # the prefix blocks were found by hash and shared
    kv.set_pin(a, 10)
    kv.set_pin(b, 10)
    assert kv.num_pinned_blocks == 4  # 2 shared + 1 + 1
    kv.check_invariants()


def test_pin_on_running_session_applies_when_it_parks_and_admission_consumes_it() -> None:
    kv, _ = make_kv(16)
    s = kv.get_or_create("s", "p")
    prompt = toks(0, 10)
    kv.attach(s, prompt, kv.plan_prefix(s, prompt))
    kv.ensure_slots(s, 10)
    kv.commit_tokens(s, prompt)
    r = kv.set_pin(s, 30.0)
    assert r.deferred and kv.num_pinned_blocks == 0
    kv.park(s)
    assert kv.num_pinned_blocks == 3
    nxt = prompt + [7, 7]
    kv.attach(s, nxt, kv.plan_prefix(s, nxt))
    # Attached but not yet admitted (it may still wait for memory): the context stays pinned.
    assert kv.num_pinned_blocks == 3 and s.pin_deadline_s is not None
    kv.consume_pin(s)  # the scheduler admitted the turn
    assert kv.num_pinned_blocks == 0 and s.pin_deadline_s is None
    kv.check_invariants()


def test_offload_to_host_and_reload_as_a_hit() -> None:
    kv, _ = make_kv(8, host=8)
    a = park_context(kv, "a", toks(0, 16))
    park_context(kv, "b", toks(100, 16))
    assert take(kv, 4)
    assert len(a.block_ids) == 0 and len(a.host_block_ids) == 4
    assert [op.kind for op in kv.take_copies()] == ["d2h"] * 4
    kv.release_program("b")
    prompt = toks(0, 16) + [1, 2]
    plan = kv.plan_prefix(a, prompt)
    assert plan.num_host_tokens == 16 and plan.num_cached_tokens == 0
    kv.attach(a, prompt, plan)
    assert [op.kind for op in kv.take_copies()] == ["h2d"] * 4
    assert a.num_device_tokens == 16 and not a.host_block_ids
    assert kv.host_hits.num_observed == 1 and kv.host_hits.fraction() == 1.0  # all came back from the host
    kv.check_invariants()


def test_host_hit_share_counts_what_the_host_tier_lost() -> None:
    """What ``CacheState.host_hit_fraction`` reports: of evicted contexts, the share the host gave back."""
    kv, _ = make_kv(8, host=2)
    a = park_context(kv, "a", toks(0, 16))
    park_context(kv, "b", toks(100, 16))
    assert take(kv, 4) and len(a.host_block_ids) == 2  # half of a's context fits the host
    kv.release_program("b")
    plan = kv.plan_prefix(a, toks(0, 16) + [1])
    kv.attach(a, toks(0, 16) + [1], plan)
    assert kv.host_hits.fraction() == pytest.approx(0.5)


def test_host_tier_drops_in_the_hinted_order() -> None:
    """Filled on eviction, the host drops the context needed furthest ahead."""
    kv, clock = make_kv(12, host=8)
    a = park_context(kv, "a", toks(0, 16))
    clock.advance(1.0)
    b = park_context(kv, "b", toks(100, 16))
    clock.advance(1.0)
    c = park_context(kv, "c", toks(200, 16))
    kv.set_next_use(a, 0.5)  # a returns in half a second; b has been idle longest of the unhinted
    assert take(kv, 12)  # every context leaves the device; the host holds two of the three
    assert {s.session_id for s in (a, b, c) if len(s.host_block_ids) == 4} == {"a", "c"}
    kv.check_invariants()


@pytest.mark.parametrize("hold", [False, True])
def test_lru_host_tier_drops_the_least_recently_saved_run_unless_a_queued_turn_locks_it(hold: bool) -> None:
    """``host_lru`` (the vLLM node's connector): the tier drops by when it saved a run, not by when its
    session last ran. w ran after p, but the device evicted w first (p's hint), so saving p drops w's run.
    With the queue hold (``host_hold_share``) w's turn, back and queued, locks its run: p's save finds no
    slot and p's context is lost instead."""
    kv, clock = make_kv(12, host=4, host_lru=True, host_hold_share=1.0 if hold else 0.0)
    p = park_context(kv, "p", toks(0, 16))
    clock.advance(1.0)
    w = park_context(kv, "w", toks(100, 16))
    clock.advance(1.0)
    kv.set_next_use(p, 0.5)  # p returns first: the device evicts w
    assert take(kv, 8)
    assert len(w.host_block_ids) == 4 and len(p.block_ids) == 4
    clock.advance(1.0)
    kv.set_waiting(w, arriving=True)  # w's next turn arrives and waits
    assert kv.num_host_locked_blocks == (4 if hold else 0)
    assert take(kv, 12)  # p leaves the device too
    assert (len(w.host_block_ids), len(p.host_block_ids)) == ((4, 0) if hold else (0, 4))
    kv.check_invariants()
    kv.set_waiting(w)  # (queued again: no second lock)
    assert kv.num_host_locked_blocks == (4 if hold else 0)
    kv.free_session(w)  # its turn ends unadmitted: the lock goes with it
    assert kv.num_host_locked_blocks == 0
    kv.check_invariants()


def test_write_through_saves_each_turn_and_an_eviction_copies_nothing() -> None:
    """vLLM's connectors, as the replay models them: copies as turns end, none on eviction, and the host
    keeps what it loads."""
    kv, clock = make_kv(8, host=8, host_write_through=True)
    a = park_context(kv, "a", toks(0, 16))
    assert [op.kind for op in kv.take_copies()] == ["d2h"] * 4  # the turn's 4 full blocks, at once
    assert len(a.saved_host_ids) == 4 and not a.host_block_ids
    clock.advance(1.0)
    park_context(kv, "b", toks(100, 16))
    kv.take_copies()
    assert take(kv, 4)  # evicts a (least recently used): its copies become its host run, no copy queued
    assert kv.take_copies() == []
    assert not a.block_ids and len(a.host_block_ids) == 4 and not a.saved_host_ids
    prompt = toks(0, 16) + [1, 2]
    plan = kv.plan_prefix(a, prompt)
    assert plan.num_host_tokens == 16
    kv.attach(a, prompt, plan)
    assert [op.kind for op in kv.take_copies()] == ["h2d"] * 4
    assert len(a.saved_host_ids) == 4  # reloaded blocks keep their host copies: the next save skips them
    kv.check_invariants()


def test_write_through_host_drops_the_least_recently_used_chain_whatever_the_hints() -> None:
    """A host smaller than the device pool holds the most recent turns, which the device holds too."""
    kv, clock = make_kv(12, host=4, host_write_through=True)
    a = park_context(kv, "a", toks(0, 16))
    kv.set_next_use(a, 1.0)  # hinted to return soon: the write-through host ignores it
    clock.advance(1.0)
    b = park_context(kv, "b", toks(100, 16))
    assert not a.saved_host_ids and len(b.saved_host_ids) == 4
    clock.advance(1.0)
    c = park_context(kv, "c", toks(200, 24))  # longer than the host: saves what fits, never its own chain
    assert not b.saved_host_ids and len(c.saved_host_ids) == 4 and len(c.block_ids) == 6
    assert take(kv, 8)  # a and b leave the device: nothing of theirs is on the host
    assert not a.block_ids and not a.host_block_ids and not b.host_block_ids
    kv.check_invariants()


def test_write_through_without_retained_contexts_reloads_a_finished_turn_from_the_host() -> None:
    """vLLM's own scheduler frees a finished turn's blocks; the connector's copies make it a host hit."""
    kv, _ = make_kv(8, host=10, host_write_through=True, retain_contexts=False)
    a = park_context(kv, "a", toks(0, 16))
    assert not a.block_ids and len(a.host_block_ids) == 4 and not a.saved_host_ids
    park_context(kv, "b", toks(100, 20))  # 4 blank blocks and one of a's freed ones
    prompt = toks(0, 16) + [5]
    plan = kv.plan_prefix(a, prompt)
    assert plan.num_cached_tokens + plan.num_host_tokens == 16 and plan.num_host_tokens > 0
    kv.attach(a, prompt, plan)
    kv.check_invariants()
    kv.park(a)  # (an aborted turn: nothing computed past the reloaded context)
    kv.release_program("a")
    kv.release_program("b")
    kv.check_invariants()
    assert kv.host.num_free_blocks == 10 and kv.device.num_free_blocks == 8


def test_release_frees_at_once() -> None:
    kv, _ = make_kv(8, host=4)
    park_context(kv, "a", toks(0, 16), program="p")
    park_context(kv, "b", toks(100, 12), program="p")
    assert kv.device.num_free_blocks == 1
    kv.release_program("p")
    assert kv.device.num_free_blocks == 8 and "a" not in kv.sessions and "p" not in kv.programs
    kv.check_invariants()


def test_whole_prompt_cached_still_computes_one_token() -> None:
    kv, _ = make_kv(8)
    s = park_context(kv, "a", toks(0, 8))
    plan = kv.plan_prefix(s, toks(0, 8))
    assert plan.num_hit_tokens < 8  # the last token's logits must come from a forward pass


def test_prefetch_reloads_offloaded_context_before_return_without_evicting() -> None:
    kv, clock = make_kv(8, host=8)
    a = park_context(kv, "a", toks(0, 16))
    b = park_context(kv, "b", toks(100, 16))
    held = kv.allocate_device(4)  # a is evicted to host (LRU: the older one)
    assert held is not None and len(a.host_block_ids) == 4
    kv.take_copies()
    kv.set_prefetch(a, 2.0)
    kv.tick()
    assert len(a.host_block_ids) == 4  # not due yet
    for blk in held[:3]:
        kv.device.unref(blk)  # three blocks come free
    clock.advance(2.0)
    assert kv.tick()
    # Only free blocks were used: b kept its context, a got back what fit, in order.
    assert len(b.block_ids) == 4 and len(a.block_ids) == 3 and len(a.host_block_ids) == 1
    assert [op.kind for op in kv.take_copies()] == ["h2d"] * 3
    plan = kv.plan_prefix(a, toks(0, 16) + [5])
    assert plan.num_cached_tokens == 12 and plan.num_host_tokens == 4
    kv.device.unref(held[3])
    kv.check_invariants()


def test_prefetch_leaves_free_blocks_to_a_turn_waiting_for_memory() -> None:
    kv, clock = make_kv(8, host=8)
    a = park_context(kv, "a", toks(0, 16))
    park_context(kv, "b", toks(100, 16))
    held = kv.allocate_device(4)  # a is evicted to host
    assert held is not None and len(a.host_block_ids) == 4
    kv.take_copies()
    kv.set_prefetch(a, 1.0)
    for blk in held:
        kv.device.unref(blk)  # four blocks come free ...
    c = kv.get_or_create("c", "c")
    kv.set_waiting(c)  # ... while a queued turn waits for memory
    clock.advance(1.0)
    kv.tick()
    # The prefetch would take the blocks the queued turn needs: it is skipped, a stays on host.
    assert len(a.host_block_ids) == 4 and not a.block_ids and kv.device.num_free_blocks == 4
    assert kv.stats.skipped_prefetches == 1 and kv.take_copies() == []
    kv.check_invariants()
