"""The vLLM session book's edge cases (``engine_adapter.vllm_backend._sessions``) on the fake block pool of
``tests/test_vllm_infer_unit.py``: no vLLM needed, a virtual clock.

- a request that ends without blocks (its queued next turn aborted before admission) keeps the session's
  pin and last context: the lease runs to its deadline, which ``expire`` still enforces;
- under vLLM's deferred block free the book holds the pinned prefix with references of its own and
  frees nothing (vLLM frees the request's own references later);
- a pin an explicit hint drops is not counted as yielded; one dropped for an older program's turn is;
- ``drop_all_pins`` (vLLM's prefix-cache reset) lets every pin go.

``tests/test_vllm_sched_edges.py`` checks the same paths through vLLM's real scheduler.
"""

from __future__ import annotations

import itertools

from engine_adapter.vllm_backend._infer import HintInference
from engine_adapter.vllm_backend._sessions import SessionBook, VSession
from tests.test_vllm_infer_unit import Blk, Clock, Pool

_ids = itertools.count(1000)


def _book() -> tuple[SessionBook, Pool, Clock]:
    clock, pool = Clock(), Pool()
    return SessionBook(pool, 100, pin_budget_fraction=0.5, clock=clock), pool, clock


def _finished_turn(book: SessionBook, sid: str, rid: str, n: int = 4) -> tuple[VSession, list[Blk]]:
    s = book.session(sid)
    book.on_request_added(s, rid)
    book.on_admitted(s, rid)
    blocks = [Blk(next(_ids), block_hash=(sid, rid, i)) for i in range(n)]
    book.on_request_finished(s, rid, blocks)
    return s, blocks


def test_an_aborted_queued_turn_keeps_the_pin_until_its_deadline() -> None:
    book, _, clock = _book()
    s, blocks = _finished_turn(book, "a", "r1")
    assert book.set_pin(s, 10.0).pinned_blocks == 4
    book.on_request_added(s, "r2")  # the next turn is queued ...
    clock.t = 12.0
    book.expire()  # past the deadline while it waits: the lease is kept (and its heap entry popped)
    assert book.num_pinned_blocks == 4
    book.on_request_finished(s, "r2", [])  # ... and aborted before admission: it had no blocks
    assert len(s.held) == 4 and [b for b, _ in s.snapshot] == blocks  # the last context is still pinned
    assert s.state == "parked"
    book.expire()  # the deadline has passed: the lease goes now, not never
    assert book.num_pinned_blocks == 0 and all(b.ref_cnt == 0 for b in blocks)
    assert book.stats.pin_expiries == 1
    book.check_invariants()


def test_an_aborted_queued_turn_leaves_a_live_lease_running() -> None:
    book, _, clock = _book()
    s, _ = _finished_turn(book, "a", "r1")
    book.set_pin(s, 10.0)
    book.on_request_added(s, "r2")
    book.on_request_finished(s, "r2", [])
    clock.t = 5.0
    book.expire()
    assert book.num_pinned_blocks == 4  # before the deadline: still held
    clock.t = 10.5
    book.expire()
    assert book.num_pinned_blocks == 0


def test_a_pin_sent_while_the_aborted_turn_waited_applies_to_the_last_context() -> None:
    book, pool, _ = _book()
    s, blocks = _finished_turn(book, "a", "r1")  # no pin: freed at the turn's end (ref 0), still cached
    assert pool.free_block_queue.items == blocks[::-1]  # tail first, as vLLM frees
    book.on_request_added(s, "r2")
    assert book.set_pin(s, 30.0).deferred  # "applies when the running turn ends"
    book.on_request_finished(s, "r2", [])  # ended without computing anything: the pin takes turn 1's blocks
    assert len(s.held) == 4 and all(b.ref_cnt == 1 for b in blocks)
    assert pool.free_block_queue.items == []
    book.check_invariants()


def test_under_a_deferred_block_free_the_book_frees_nothing_and_holds_its_own_references() -> None:
    book, _, _ = _book()
    s = book.session("a")
    book.on_request_added(s, "r1")
    book.on_admitted(s, "r1")
    book.set_pin(s, 60.0)  # deferred: the turn runs
    blocks = [Blk(i, block_hash=("a", i)) for i in range(5)]
    blocks.append(Blk(99, block_hash=None))  # the partial last block: never pinned
    book.on_request_finished(s, "r1", blocks, owned=False)
    assert [b.ref_cnt for b in blocks] == [2, 2, 2, 2, 2, 1]  # the request's own references stay vLLM's
    assert len(s.snapshot) == 5 and len(s.held) == 5
    book.release_program("a")
    assert [b.ref_cnt for b in blocks] == [1] * 6  # what vLLM's deferred free will drop
    assert "a" not in book.sessions


def test_only_pins_dropped_for_an_older_turn_count_as_yielded() -> None:
    book, _, _ = _book()
    inf = HintInference(book, reload_s_per_token=0.1)
    s = book.session("p", "p")
    book.on_request_added(s, "r1")
    inf.on_request(s, {"program_id": "p"})
    book.on_admitted(s, "r1")
    inf.on_turn_end(s, 4 * 128)
    book.on_request_finished(s, "r1", [Blk(next(_ids), block_hash=("p", i)) for i in range(4)])
    assert book.num_pinned_blocks == 4
    inf.note_explicit("p")  # the orchestrator speaks for the session: its inferred pin goes, not a yield
    assert book.num_pinned_blocks == 0 and book.stats.yielded_pins == 0
    s2, _ = _finished_turn(book, "q", "r2")
    book.set_pin(s2, 10.0)
    assert book.drop_pin(s2, yielded=True) == 4 and book.stats.yielded_pins == 1


def test_drop_all_pins_lets_every_pin_go_deferred_ones_too() -> None:
    book, _, _ = _book()
    a, blocks = _finished_turn(book, "a", "r1")
    book.set_pin(a, 60.0)
    b = book.session("b")
    book.on_request_added(b, "r2")
    book.set_pin(b, 60.0)  # deferred on a running turn
    assert book.drop_all_pins() == 4
    assert book.num_pinned_blocks == 0 and all(x.ref_cnt == 0 for x in blocks)
    assert a.pin_deadline_s is None and b.pin_deadline_s is None
    book.check_invariants()


def test_each_pause_ends_with_the_fate_of_its_pin() -> None:
    """``pause_fate``: what became of the context since the turn ended, read when the next turn arrives
    (the accounting tells recomputed tokens apart by it): a pin held whole, clamped by the budget, yielded,
    dropped by the deadlock rule, lapsed, or none."""
    book, _, clock = _book()  # budget: 50 of 100 blocks
    a, _ = _finished_turn(book, "a", "r1")
    assert a.pause_fate == "unpinned"  # no pin asked
    book.set_pin(a, 10.0)
    assert a.pause_fate == "pinned"
    big, _ = _finished_turn(book, "big", "r2", n=60)
    book.set_pin(big, 10.0)  # 46 of its 60 blocks fit beside a's 4
    assert big.pause_fate == "clamped" and book.num_pinned_blocks == 50
    full, _ = _finished_turn(book, "full", "r3")
    book.set_pin(full, 10.0)  # nothing left in the budget
    assert full.pause_fate == "clamped" and not full.held
    book.drop_pin(big, yielded=True)
    assert big.pause_fate == "yielded"
    book.set_pin(a, 0.0)  # taken back (a zero TTL)
    assert a.pause_fate == "unpinned"
    clock.t += 0.1
    c, _ = _finished_turn(book, "c", "r4")  # the latest program seen
    book.set_pin(c, 5.0)
    assert book.force_unpin_latest() and c.pause_fate == "forced"  # c is the latest program pinned
    d, _ = _finished_turn(book, "d", "r5")
    book.set_pin(d, 1.0)
    clock.t += 2.0
    book.expire()
    assert d.pause_fate == "expired"
    book.set_pin(d, 5.0)  # a policy renewing late pins what is left: the pause still lost its context
    assert d.pause_fate == "expired"
    # a turn that ends starts a new pause: its pin (granted at the end) decides again
    book.on_request_added(d, "r6")
    book.on_admitted(d, "r6")
    book.on_request_finished(d, "r6", [Blk(next(_ids), block_hash=("d", "r6", i)) for i in range(4)])
    assert d.pause_fate == "unpinned"


def test_a_queue_hold_keeps_a_waiting_turns_context_until_admission_and_is_no_pin() -> None:
    book, pool, clock = _book()
    s, blocks = _finished_turn(book, "a", "r1")  # no pin: its blocks are free, still cached
    book.on_request_added(s, "r2")
    clock.t = 5.0
    assert book.hold_queued(s) == 4 and s.queue_hold
    assert all(b.ref_cnt == 1 for b in blocks) and pool.free_block_queue.items == []
    assert s.pause_fate == "unpinned"  # the pause is over: its fate stands
    assert book.stats.queue_holds == 1 and book.stats.pin_clamps == 0
    clock.t = 60.0
    book.expire()  # the hold's lease lapsed at once, but the turn still waits: held
    assert book.num_pinned_blocks == 4 and book.stats.pin_expiries == 0
    book.on_admitted(s, "r2")  # vLLM's prefix hit took its own references: the hold lets go
    assert not s.held and not s.queue_hold and s.pin_deadline_s is None
    book.check_invariants()


def test_an_aborted_turns_queue_hold_goes_at_the_next_expiry() -> None:
    book, _, clock = _book()
    s, blocks = _finished_turn(book, "a", "r1")
    book.on_request_added(s, "r2")
    assert book.hold_queued(s) == 4
    book.on_request_finished(s, "r2", [])  # aborted while queued
    clock.t = 0.1
    book.expire()
    assert book.num_pinned_blocks == 0 and not s.queue_hold and all(b.ref_cnt == 0 for b in blocks)
    book.check_invariants()


def test_a_queue_hold_takes_nothing_from_a_pin_and_stops_at_the_budget() -> None:
    book, _, _ = _book()  # budget: 50 of 100 blocks
    p, _ = _finished_turn(book, "p", "r1", n=48)
    assert book.set_pin(p, 30.0).pinned_blocks == 48
    book.on_request_added(p, "r2")
    assert book.hold_queued(p) == 0 and not p.queue_hold  # already pinned: its pin holds it
    s, _ = _finished_turn(book, "a", "r3", n=4)
    book.on_request_added(s, "r4")
    assert book.hold_queued(s) == 2 and s.queue_hold  # what the budget leaves
    assert book.stats.pin_clamps == 0  # a hold cut short is not a pin clamp
    book.check_invariants()
