"""Both engines let pins go in the same order (``engine_adapter._pin_order``): the embedded node's
``SessionTable`` and the vLLM node's ``SessionBook`` (on the fake block pool of ``test_vllm_infer_unit``).

One scene on each: program A (started first) with two pinned sessions, program C (started second) with
one, program B (started last) with two. The deadlock rule takes every pin of B, and only B's; the yield
rule, for a turn of a program that started between A and C, takes B's pins (the later-seen session first),
then C's, and never A's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine_adapter import KVCacheManager, VirtualClock
from engine_adapter._pin_order import deadlock_victims, program_start, yield_order
from engine_adapter.vllm_backend._sessions import SessionBook
from tests.test_kv_manager import park_context
from tests.test_vllm_infer_unit import Blk, Clock, Pool

SCENE = [  # (session, program, program start, tokens)
    ("a1", "A", 0.0, 8), ("a2", "A", 0.0, 8), ("c1", "C", 3.0, 8), ("b1", "B", 5.0, 8), ("b2", "B", 5.0, 8),
]  # fmt: skip


def _embedded() -> tuple[KVCacheManager, dict[str, Any]]:
    clock = VirtualClock()
    kv = KVCacheManager(64, 0, 4, clock, pin_budget_fraction=0.9)
    out: dict[str, Any] = {}
    for i, (sid, prog, start, n) in enumerate(SCENE):
        clock.advance(0.1)  # seen in this order
        s = park_context(kv, sid, [i * 100 + j for j in range(n)], program=prog)
        s.program_start_s = start
        assert kv.set_pin(s, 60.0).pinned_blocks == n // 4
        out[sid] = s
    return kv, out


def _vllm() -> tuple[SessionBook, dict[str, Any]]:
    clock = Clock()
    book = SessionBook(Pool(), 64, pin_budget_fraction=0.9, clock=clock)
    out: dict[str, Any] = {}
    for i, (sid, prog, start, n) in enumerate(SCENE):
        clock.t += 0.1
        s = book.session(sid, prog)
        s.program_start_s = start
        book.on_request_added(s, f"r{i}")
        book.on_admitted(s, f"r{i}")
        book.on_request_finished(s, f"r{i}", [Blk(1000 + i * 10 + j, block_hash=(sid, j)) for j in range(n // 4)])
        assert book.set_pin(s, 60.0).pinned_blocks == n // 4
        out[sid] = s
    return book, out


def _pinned_embedded(ss: dict[str, Any]) -> set[str]:
    return {sid for sid, s in ss.items() if s.pinned_blocks}


def _pinned_vllm(ss: dict[str, Any]) -> set[str]:
    return {sid for sid, s in ss.items() if s.held}


def test_the_deadlock_rule_takes_every_pin_of_the_latest_program_on_both_engines() -> None:
    kv, es = _embedded()
    book, vs = _vllm()
    assert kv.force_unpin_latest() and book.force_unpin_latest()
    assert _pinned_embedded(es) == _pinned_vllm(vs) == {"a1", "a2", "c1"}
    assert kv.stats.forced_unpins == book.stats.forced_unpins == 1
    assert kv.force_unpin_latest() and book.force_unpin_latest()  # then C, then A
    assert _pinned_embedded(es) == _pinned_vllm(vs) == {"a1", "a2"}
    assert kv.force_unpin_latest() and book.force_unpin_latest()
    assert not kv.force_unpin_latest() and not book.force_unpin_latest()  # nothing left: says so
    kv.check_invariants()
    book.check_invariants()


def test_pins_yield_to_an_older_turn_youngest_first_on_both_engines() -> None:
    kv, es = _embedded()
    order = []
    while kv.yield_pin_to(1.0):  # a turn of a program that started at 1.0: younger than A only
        order.append(next(sid for sid in ("b2", "b1", "c1", "a2", "a1") if sid not in order and not es[sid].pinned_blocks))
    assert order == ["b2", "b1", "c1"] and _pinned_embedded(es) == {"a1", "a2"}
    assert kv.stats.yielded_pins == 3
    kv.check_invariants()
    # the vLLM node drops pins in the order yield_order gives (QueueRules._yield_pins_to_older)
    book, _ = _vllm()
    pinned = [s for s in book.sessions.values() if s.held]
    got = yield_order(pinned, 1.0, start=lambda s: program_start(s.program_start_s, s.first_seen_s),
                      seen=lambda s: s.first_seen_s)  # fmt: skip
    assert [s.session_id for s in got] == order


def test_a_program_that_started_at_time_zero_is_the_oldest() -> None:
    # (a falsy start must not fall back to when the session was first seen)
    assert program_start(0.0, 7.0) == 0.0 and program_start(None, 7.0) == 7.0
    sessions = [("x", "X", 0.0, 9.0), ("y", "Y", 4.0, 1.0)]  # X started first but was seen later
    victims = deadlock_victims(sessions, start=lambda s: s[2], seen=lambda s: s[3], program=lambda s: s[1])
    assert [v[0] for v in victims] == ["y"]


def test_leases_run_out_alike_on_both_engines_but_hold_while_the_next_turn_waits() -> None:
    """One lease rule (``engine_adapter._pin_lease``): past its deadline a parked session's pin goes and is
    counted; a session whose next turn is queued keeps it until that turn is admitted."""
    kv, es = _embedded()
    book, vs = _vllm()
    kv.set_waiting(es["a1"])  # a1's next turn is queued on both nodes
    book.on_request_added(vs["a1"], "a1-next")
    kv.clock.advance(61.0)  # type: ignore[attr-defined]
    book.clock.t += 61.0  # type: ignore[attr-defined]
    assert kv.tick() and book.expire()
    assert _pinned_embedded(es) == _pinned_vllm(vs) == {"a1"}
    assert kv.stats.pin_expiries == book.stats.pin_expiries == 4
    kv.consume_pin(es["a1"])  # admitted: the pin did its job, and is not counted as run out
    book.on_admitted(vs["a1"], "a1-next")
    assert _pinned_embedded(es) == _pinned_vllm(vs) == set()
    assert kv.num_pinned_blocks == book.num_pinned_blocks == 0
    assert kv.stats.pin_expiries == book.stats.pin_expiries == 4
    kv.check_invariants()
    book.check_invariants()


def test_the_pin_budget_counts_distinct_blocks_on_both_engines() -> None:
    kv, es = _embedded()  # 64 blocks at 0.9: a budget of 57; the scene pins 10
    book, vs = _vllm()
    assert kv.pin_budget_blocks == book.pin_budget_blocks == 57
    assert kv.num_pinned_blocks == book.num_pinned_blocks == 10
    assert kv.set_pin(es["a1"], 30.0).pinned_blocks == book.set_pin(vs["a1"], 30.0).pinned_blocks == 2
    assert kv.num_pinned_blocks == book.num_pinned_blocks == 10  # a renewed lease pins nothing twice
    kv.check_invariants()
    book.check_invariants()


class _Req:
    def __init__(self, rid: str, num_tokens: int) -> None:
        self.request_id, self.num_tokens, self.num_computed_tokens = rid, num_tokens, 0


def _queue_rules(book: SessionBook, free: int, to: str) -> Any:
    """The vLLM node's queue rules over the book, with a pool that has ``free`` blocks besides what pins
    let go (no vLLM: the rules read only these attributes)."""
    from engine_adapter.vllm_backend._admission import QueueRules

    pool = book.pool

    class Node(QueueRules):
        block_size, max_num_scheduled_tokens, max_num_running_reqs = 4, 64, 8
        running: ClassVar[list[Any]] = []

        class kv_cache_manager:
            class block_pool:
                @staticmethod
                def get_num_free_blocks() -> int:
                    return free + len(pool.free_block_queue.items)

    node = Node()
    node.book, node.yield_pins_to, node.waiting, node._req_session = book, to, [], {}
    return node


@pytest.mark.parametrize("to", ["queue", "head"])
def test_pins_yield_to_every_turn_the_step_could_start_not_only_the_head(to: str) -> None:
    """A's pinned session's turn heads the queue and fits in its pin; behind it waits a turn of program D
    (started at 4.0, between C and B) that the pool cannot take. Pins give way to it too (B's later-seen
    session first, then no more than it needs), as the embedded node's scheduler asks every turn it tries;
    with ``head`` they gave way to the head alone, and D's turn waited behind B's pins."""
    book, vs = _vllm()
    d = book.session("d1", "D")
    d.program_start_s = 4.0
    node = _queue_rules(book, free=3, to=to)
    for rid, s, n in (("a1-next", vs["a1"], 10), ("d1-first", d, 8)):
        node.waiting.append(_Req(rid, n))
        node._req_session[rid] = s
    node._yield_pins_to_older()
    # a1's turn: 10 tokens, 8 kept, so 2 more blocks with the lookahead one (3 free: fits); D's: 3 blocks
    want = {"a1", "a2", "c1", "b1"} if to == "queue" else {"a1", "a2", "c1", "b1", "b2"}
    assert _pinned_vllm(vs) == want
    assert book.stats.yielded_pins == (1 if to == "queue" else 0)
    book.check_invariants()
