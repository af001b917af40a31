"""Scheduler on a real torch executor: priority order, cold-prefill budget, preemption, correctness."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_adapter import (
    EngineCore,
    EngineMetrics,
    InvalidArgument,
    Request,
    ScheduledBatch,
    SchedulerConfig,
    VirtualClock,
    make_torch_executor,
)
from hints import Pin, Priority, Release


def make_core(blocks: int = 64, host: int = 0, **sched: int) -> EngineCore:
    ex = make_torch_executor(num_device_blocks=blocks, num_host_blocks=host)
    return EngineCore(ex, clock=VirtualClock(), scheduler_config=SchedulerConfig(**sched))


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(512) for _ in range(n)]


def test_greedy_output_matches_reference_and_second_turn_hits() -> None:
    core = make_core()
    rng = random.Random(1)
    p1 = rand_tokens(rng, 70)
    r1 = core.submit(p1, 3, session_id="s", program_id="p")
    core.run_until_idle()
    assert r1.output[0] == int(core.executor.reference_logits(p1).argmax())  # type: ignore[attr-defined]
    p2 = p1 + r1.output + rand_tokens(rng, 9)
    r2 = core.submit(p2, 2, session_id="s", program_id="p")
    core.run_until_idle()
    # Everything computed before (prompt + outputs but the last) is reused across the turn boundary.
    assert r2.num_cached_tokens == len(p1) + len(r1.output) - 1
    assert r2.num_recomputed_tokens == 0
    assert r2.output[0] == int(core.executor.reference_logits(p2).argmax())  # type: ignore[attr-defined]
    core.check_invariants()


def test_program_fcfs_priority_orders_the_queue() -> None:
    core = make_core(max_num_seqs=1)
    rng = random.Random(2)
    for sid in ("young", "old"):
        core.submit(rand_tokens(rng, 8), 1, session_id=sid, program_id=sid)
    core.run_until_idle()
    order: list[str] = []

    def note(req: Request, toks: list[int], done: bool) -> None:
        if done:
            order.append(req.session.session_id)

    core.submit(rand_tokens(rng, 8), 2, session_id="young", on_event=note)
    core.submit(rand_tokens(rng, 8), 2, session_id="old", on_event=note)
    res = core.apply_hints(
        [
            Priority(session_id="young", program_age_s=1.0),
            Priority(session_id="old", program_age_s=100.0),
        ]
    )
    assert all(r.ok for r in res)
    core.run_until_idle()
    assert order == ["old", "young"]  # the older program first although it arrived second


class _Turns:
    """One request at a time; turns of 8 tokens, each its own program, in the order they finish."""

    def __init__(self, **sched: Any) -> None:
        self.core = make_core(max_num_seqs=1, **sched)
        self.rng = random.Random(6)
        self.order: list[str] = []

    def _note(self, req: Request, toks: list[int], done: bool) -> None:
        if done:
            self.order.append(req.session.session_id)

    def young(self) -> None:
        self.core.submit(rand_tokens(self.rng, 8), 4, session_id="young", program_id="young", on_event=self._note)

    def old(self, name: str) -> None:  # a turn of a program that started 100 s ago
        self.core.submit(rand_tokens(self.rng, 8), 4, session_id=name, program_id=name, on_event=self._note)
        self.core.apply_hints([Priority(session_id=name, program_age_s=100.0)])


def test_ttft_deadline_puts_an_overdue_request_ahead_of_older_programs() -> None:
    def order_of(deadline_s: float | None) -> list[str]:
        t = _Turns(ttft_deadline_s=deadline_s)
        core, old_turn, order = t.core, t.old, t.order
        t.young()
        old_turn("old0")
        core.step()  # old0 (the older program) runs first; young waits
        assert isinstance(core.clock, VirtualClock)
        core.clock.advance(10.0)
        old_turn("old1")  # arrives 10 s after young, but its program is older
        core.run_until_idle()
        return order

    assert order_of(None) == ["old0", "old1", "young"]  # strict program FCFS: young waits behind old1
    assert order_of(5.0) == ["old0", "young", "old1"]  # young waited past 5 s: it goes before old1


def test_the_fcfs_bound_puts_a_turn_ahead_once_fcfs_would_have_started_it() -> None:
    # One request at a time. young arrives with nothing queued ahead of it (old0 already runs), so FCFS
    # would start it next; old1 arrives after it from an older program. Strict program FCFS starts old1
    # first; with the bound (slack 0) young is due at once and goes before old1.
    def order_of(slack: float | None) -> list[str]:
        t = _Turns(fcfs_slack=slack)
        core, old_turn, order = t.core, t.old, t.order
        old_turn("old0")
        core.step()  # old0 runs; the queue is empty
        t.young()
        old_turn("old1")  # after young, but its program is older
        core.run_until_idle()
        core.check_invariants()
        assert len(core.scheduler.fcfs_bound) == 0  # nothing left tracked
        return order

    assert order_of(None) == ["old0", "old1", "young"]  # strict program FCFS: young waits behind old1
    assert order_of(0.0) == ["old0", "young", "old1"]  # FCFS would have started young first


def test_pins_give_way_to_an_overdue_request_while_others_run() -> None:
    # 24 blocks x 16 tokens.  A parked, pinned 240-token context holds 15 blocks; a decoding request
    # holds 2 more.  A 200-token cold prompt (13 blocks) that waited past the deadline must not wait for
    # the decode to finish and the node to drain (the deadlock rule): the pin yields at once.
    core = make_core(blocks=24, ttft_deadline_s=1.0)
    rng = random.Random(7)
    core.submit(rand_tokens(rng, 240), 1, session_id="pinned", program_id="p")
    core.run_until_idle()
    assert all(r.ok for r in core.apply_hints([Pin(session_id="pinned", ttl_s=600.0)]))
    runner = core.submit(rand_tokens(rng, 20), 200, session_id="runner", program_id="r")
    core.step()
    late = core.submit(rand_tokens(rng, 200), 1, session_id="late", program_id="l")
    core.step()
    assert late.first_token_s is None  # not overdue yet: the pin holds and the prompt waits
    assert isinstance(core.clock, VirtualClock)
    core.clock.advance(2.0)
    for _ in range(3):
        core.step()
    assert late.first_token_s is not None and runner.first_token_s is not None
    assert len(runner.output) < 200  # the decode was still running: no drain was needed
    assert core.kv.stats.forced_unpins == 1
    core.run_until_idle()
    core.check_invariants()


def test_history_is_what_the_session_had_when_its_turn_first_tried_to_start() -> None:
    # 20 blocks x 16 tokens.  The second turn of "a" finds its history cached but no room to grow while
    # "b" decodes; the failed try cut a's tokens back to whole cached blocks.  Its history must still
    # be everything turn 1 computed, and what it then re-prefills must count as recomputed.
    core = make_core(blocks=20)
    rng = random.Random(8)
    p1 = rand_tokens(rng, 100)
    r1 = core.submit(p1, 2, session_id="a", program_id="a")
    core.run_until_idle()
    b = core.submit(rand_tokens(rng, 180), 40, session_id="b", program_id="b")
    core.step()
    r2 = core.submit(p1 + r1.output + rand_tokens(rng, 150), 1, session_id="a", program_id="a")
    core.step()
    assert r2.first_token_s is None  # no room yet: it waits
    core.run_until_idle()
    assert b.output and r2.output
    assert r2.num_history_tokens == len(p1) + len(r1.output) - 1
    assert r2.num_recomputed_tokens == r2.num_history_tokens - min(r2.num_cached_tokens, r2.num_history_tokens)
    core.check_invariants()


def test_cold_prefill_budget_lets_warm_resume_through() -> None:
    core = make_core(
        blocks=200, max_num_batched_tokens=256, cold_prefill_budget_tokens=64, warm_threshold_tokens=32
    )
    rng = random.Random(3)
    warm_prompt = rand_tokens(rng, 100)
    r0 = core.submit(warm_prompt, 1, session_id="warm")
    core.run_until_idle()
    cold = core.submit(rand_tokens(rng, 1500), 1, session_id="cold")
    warm = core.submit(warm_prompt + r0.output + rand_tokens(rng, 10), 1, session_id="warm")
    steps = 0
    while warm.first_token_s is None:
        core.step()
        steps += 1
    assert steps == 1  # the warm resume got its token in the first step
    assert cold.first_token_s is None  # the cold prompt was capped, not starving anyone
    core.run_until_idle()
    assert cold.output and cold.num_computed >= 1500
    core.check_invariants()


@pytest.mark.parametrize(("lookahead", "warm_first_step"), [(64, True), (2, False)])
def test_a_warm_resume_overtakes_at_most_admission_lookahead_queued_requests(
    lookahead: int, warm_first_step: bool
) -> None:
    """Behind three queued cold prompts a warm resume starts in the first step when the admission pass may
    look that deep, and waits for the queue ahead when it may look only two requests in (the bound that
    keeps an overloaded node's step from re-planning thousands of queued requests)."""
    core = make_core(blocks=400, max_num_batched_tokens=256, cold_prefill_budget_tokens=64,
                     warm_threshold_tokens=32, max_num_seqs=2, admission_lookahead=lookahead)
    rng = random.Random(4)
    warm_prompt = rand_tokens(rng, 100)
    r0 = core.submit(warm_prompt, 1, session_id="warm")
    core.run_until_idle()
    colds = [core.submit(rand_tokens(rng, 600), 1, session_id=f"cold{i}") for i in range(3)]
    warm = core.submit(warm_prompt + r0.output + rand_tokens(rng, 10), 1, session_id="warm")
    core.step()
    assert (warm.first_token_s is not None) is warm_first_step
    core.run_until_idle()
    assert warm.output and all(c.output for c in colds)
    core.check_invariants()


def test_cold_prefill_uses_whole_budget_when_alone() -> None:
    core = make_core(blocks=200, max_num_batched_tokens=256, cold_prefill_budget_tokens=64)
    req = core.submit(list(range(500)), 1, session_id="c")
    core.step()
    assert req.num_computed == 256  # work-conserving: no cap when nothing else runs


def test_capped_cold_prefill_reserves_its_prompt_and_never_preempts() -> None:
    # 40 blocks x 16 = 640 tokens: two 400-token cold prompts cannot both fit.  Chunk by chunk (64 per
    # step while warm work shares the step), both would start and the later one would preempt the
    # earlier half-way; reserved at admission, the second waits until the first is done.
    core = make_core(
        blocks=40, max_num_batched_tokens=256, cold_prefill_budget_tokens=64, warm_threshold_tokens=32
    )
    rng = random.Random(5)
    warm = core.submit(rand_tokens(rng, 40), 30, session_id="warm")  # decodes while the cold prompts run
    core.step()
    a = core.submit(rand_tokens(rng, 400), 1, session_id="a")
    b = core.submit(rand_tokens(rng, 400), 1, session_id="b")
    core.step()
    assert len(a.session.block_ids) * 16 >= 400  # the whole prompt, although only a 64-token chunk ran
    assert a.num_computed <= 64
    core.run_until_idle()
    assert core.scheduler.num_preemptions == 0
    assert a.output and b.output and len(warm.output) == 30
    core.check_invariants()


@pytest.mark.parametrize("whole", [False, True])
def test_admitting_on_the_whole_prompt_keeps_chunked_prefills_from_preempting_each_other(whole: bool) -> None:
    # 40 blocks x 16 = 640 tokens, 256 tokens a step, no cold cap: two 400-token prompts fit one at a time.
    # Admitted on its first chunk (the default), b starts while a decodes and the two outgrow the pool (a
    # preemption); admitted only while its whole prompt fits (vLLM's rule, admit_whole_prompt), b waits.
    core = make_core(blocks=40, max_num_batched_tokens=256, cold_prefill_budget_tokens=256,
                     admit_whole_prompt=whole)  # fmt: skip
    rng = random.Random(6)
    a = core.submit(rand_tokens(rng, 400), 40, session_id="a")  # decodes while b's prompt would run
    b = core.submit(rand_tokens(rng, 400), 40, session_id="b")
    core.run_until_idle()
    assert len(a.output) == len(b.output) == 40
    assert (core.scheduler.num_preemptions == 0) is whole
    core.check_invariants()


def test_preemption_when_running_request_cannot_grow() -> None:
    core = make_core(blocks=12)  # 12 blocks x 16 tokens = 192 tokens
    rng = random.Random(4)
    prompts = [rand_tokens(rng, 60), rand_tokens(rng, 60)]
    reqs = [core.submit(p, 60, session_id=f"s{i}") for i, p in enumerate(prompts)]
    forward: list[int] = []

    class Count:
        def on_step(self, batch: ScheduledBatch, out: object) -> None:
            forward.append(batch.num_tokens)

        def on_request_finished(self, req: object) -> None: ...

        def on_hints(self, hints: object, results: object) -> None: ...

    core.observers.append(Count())
    core.run_until_idle()
    num_forward = sum(forward)
    assert core.scheduler.num_preemptions >= 1
    # Every token run forward is a prompt token not found cached, an output's decode, or work a preemption
    # lost and redid, which counts as recomputed.
    assert sum(r.num_recomputed_tokens for r in reqs) > 0
    assert num_forward == sum(len(r.prompt) - r.num_cached_tokens - r.num_host_hit_tokens + len(r.output) - 1
                              + r.num_recomputed_tokens for r in reqs)
    for p, r in zip(prompts, reqs, strict=True):
        assert len(r.output) == 60
        # The preempted request recomputed or reused its context; its tokens are still exact.
        assert r.output[0] == int(core.executor.reference_logits(p).argmax())  # type: ignore[attr-defined]
        full = p + r.output[:-1]
        assert r.output[-1] == int(core.executor.reference_logits(full).argmax())  # type: ignore[attr-defined]
    core.check_invariants()


def test_pinned_context_survives_competing_load() -> None:
    core = make_core(blocks=24)
    rng = random.Random(5)
    p = rand_tokens(rng, 100)
    r = core.submit(p, 1, session_id="agent", program_id="agent")
    core.run_until_idle()
    assert core.apply_hints([Pin(session_id="agent", ttl_s=60.0)])[0].pinned_blocks > 0
    for i in range(6):  # each of these needs most of the unpinned pool
        core.submit(rand_tokens(rng, 150), 1, session_id=f"load{i}")
    core.run_until_idle()
    nxt = core.submit(p + r.output + rand_tokens(rng, 5), 1, session_id="agent")
    core.run_until_idle()
    assert nxt.num_cached_tokens == len(p)
    core.check_invariants()


def test_bad_requests_are_rejected_with_the_reason() -> None:
    core = make_core(blocks=8)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        core.submit([1, 99999], 1, session_id="s")
    with pytest.raises(InvalidArgument, match="must not be empty"):
        core.submit([], 1, session_id="s")
    with pytest.raises(InvalidArgument, match="maximum length"):
        core.submit([1] * 5000, 1, session_id="s")
    with pytest.raises(InvalidArgument, match="never fit"):
        core.submit([1] * 200, 1, session_id="s")
    ok = core.submit([1, 2, 3], 2, session_id="s")
    core.run_until_idle()
    assert len(ok.output) == 2
    core.check_invariants()


def test_pins_of_parked_sessions_never_leave_the_engine_idle_with_work_waiting() -> None:
    """Two pinned contexts fill the pool; a new prompt cannot fit and nothing runs.  The deadlock rule
    lets the latest program's pins go at once (work-conserving) instead of waiting out the leases."""
    ex = make_torch_executor(num_device_blocks=12)
    core = EngineCore(ex, clock=VirtualClock(), pin_budget_fraction=0.99)
    rng = random.Random(7)
    for sid in ("older", "newer"):
        core.submit(rand_tokens(rng, 5 * 16), 1, session_id=sid, program_id=sid)
        core.run_until_idle()
        assert core.apply_hints([Pin(session_id=sid, ttl_s=3600.0)])[0].code == "OK"
    r = core.submit(rand_tokens(rng, 4 * 16), 1, session_id="third", program_id="third")
    steps = core.run_until_idle(max_steps=50)
    assert r.output and steps < 50
    assert core.kv.stats.forced_unpins == 1
    assert core.kv.sessions["older"].pinned_blocks == 5  # the older program keeps its pin
    core.check_invariants()


def test_evicting_a_shared_block_keeps_the_host_copy_behind_it() -> None:
    """Session b shares a's first block.  When b's context is offloaded block by block, the shared block
    is copied out too, so b's whole context comes back from the host instead of being recomputed."""
    core = make_core(blocks=16, host=16)
    rng = random.Random(8)
    shared = rand_tokens(rng, 16)
    pa = shared + rand_tokens(rng, 16)
    core.submit(pa, 1, session_id="a", program_id="a")
    core.run_until_idle()
    pb = shared + rand_tokens(rng, 3 * 16)
    rb = core.submit(pb, 1, session_id="b", program_id="b")
    core.run_until_idle()
    assert rb.num_cached_tokens == 16  # a's first block
    b = core.kv.sessions["b"]
    n = len(b.block_ids)
    while b.block_ids:  # what a flood does to b, block by block from the tail; the last one is shared
        core.kv._evict_one(b)
    assert len(b.host_block_ids) == n
    rb2 = core.submit(pb + rb.output, 1, session_id="b", program_id="b")
    core.run_until_idle()
    assert rb2.num_recomputed_tokens == 0
    assert rb2.num_cached_tokens + rb2.num_host_hit_tokens >= 4 * 16
    core.check_invariants()


@pytest.mark.parametrize(("aging_s", "first"), [(None, "old"), (3.0, "young")])
def test_program_fcfs_aging_bounds_an_old_programs_head_start(aging_s: float | None, first: str) -> None:
    """An old program (started at t=0) and a young one (t=10) queue turns; the old one's turn arrived at
    t=14.  Strict program FCFS serves the old program first; with 3 s aging its head start over a turn
    that has waited since t=10 is capped, so the young program's turn goes first."""
    ex = make_torch_executor(num_device_blocks=64)
    clock = VirtualClock()
    core = EngineCore(
        ex, clock=clock, scheduler_config=SchedulerConfig(max_num_seqs=1, program_fcfs_aging_s=aging_s)
    )
    rng = random.Random(10)
    for sid in ("old", "young"):
        core.submit(rand_tokens(rng, 8), 1, session_id=sid, program_id=sid)
    core.run_until_idle()
    order: list[str] = []

    def note(req: Request, toks: list[int], done: bool) -> None:
        if done:
            order.append(req.session.session_id)

    clock.advance_to(10.0)
    core.apply_hints(
        [Priority(session_id="old", program_age_s=10.0), Priority(session_id="young", program_age_s=0.0)]
    )
    core.submit(rand_tokens(rng, 8), 1, session_id="young", on_event=note)
    clock.advance_to(14.0)
    core.submit(rand_tokens(rng, 8), 1, session_id="old", on_event=note)
    core.run_until_idle()
    assert order[0] == first


@pytest.mark.parametrize("yield_pins", [False, True])
def test_pins_of_younger_programs_yield_to_an_older_programs_waiting_turn(yield_pins: bool) -> None:
    # 24 blocks x 16 tokens.  A younger program's parked context (240 tokens, 15 blocks) is pinned; a
    # decode runs (2 blocks). An older program's 200-token turn (13 blocks) arrives: with the rule the young
    # pin lets go at once (the node is not idle, so the deadlock rule would not); without it the turn waits
    # for the decode to end and the node to drain.
    core = make_core(blocks=24, yield_pins_to_older=yield_pins)
    rng = random.Random(8)
    core.submit(rand_tokens(rng, 240), 1, session_id="young", program_id="young")
    core.run_until_idle()
    assert all(r.ok for r in core.apply_hints([
        Pin(session_id="young", ttl_s=600.0),
        Priority(session_id="young", program_age_s=1.0),
    ]))
    runner = core.submit(rand_tokens(rng, 20), 200, session_id="runner", program_id="r")
    core.step()
    old = core.submit(rand_tokens(rng, 200), 1, session_id="old", program_id="old")
    assert all(r.ok for r in core.apply_hints([Priority(session_id="old", program_age_s=60.0)]))
    for _ in range(3):
        core.step()
    assert (old.first_token_s is not None) is yield_pins
    assert len(runner.output) < 200  # the decode still runs
    assert core.kv.stats.yielded_pins == (1 if yield_pins else 0)
    assert core.kv.stats.forced_unpins == 0
    core.run_until_idle()
    assert old.first_token_s is not None
    # the young program comes back: what it recomputes is put down to what became of its pin
    young = core.kv.sessions["young"]
    back = core.submit([*young.token_ids, 5], 1, session_id="young")
    core.run_until_idle()
    assert back.num_recomputed_tokens > 0
    cause = "yielded" if yield_pins else "forced"
    assert set(core.kv.stats.lost_by) == {cause}
    assert sum(core.kv.stats.lost_by.values()) == back.num_recomputed_tokens
    metrics = EngineMetrics(core).registry  # the series the vLLM node exports too
    lost = metrics.get_sample_value("hintflow_recomputed_tokens_by_cause_total",
                                    {"model_name": core.model_name, "cause": cause})  # fmt: skip
    assert lost == back.num_recomputed_tokens
    core.check_invariants()


def test_a_priority_that_comes_before_its_turn_places_the_turn_in_its_programs_order() -> None:
    # The orchestrator sends a turn's Priority as it routes the turn, so on a node new to the session the
    # hint can come first.  It records the session (no blocks), and the turn then queues as its old
    # program's, ahead of a younger program's turn that arrived before it.
    core = make_core(max_num_seqs=1)
    clock = core.clock
    assert isinstance(clock, VirtualClock)
    rng = random.Random(11)
    core.submit(rand_tokens(rng, 8), 1, session_id="young", program_id="py")
    core.run_until_idle()
    clock.advance_to(10.0)
    assert all(r.ok for r in core.apply_hints([Priority(session_id="young", program_id="py", program_age_s=0.0)]))
    blocker = core.submit(rand_tokens(rng, 8), 50, session_id="blocker", program_id="pb")
    core.step()
    order: list[str] = []

    def note(req: Request, toks: list[int], done: bool) -> None:
        if done:
            order.append(req.session.session_id)

    core.submit(rand_tokens(rng, 8), 1, session_id="young", on_event=note)
    ack = core.apply_hints([Priority(session_id="moved", program_id="po", program_age_s=60.0)])
    assert ack[0].ok and core.kv.sessions["moved"].block_ids == []
    core.submit(rand_tokens(rng, 8), 1, session_id="moved", program_id="po", on_event=note)
    core.run_until_idle()
    assert blocker.output and order == ["moved", "young"]
    # Without its program a hint still names a session the node must know; a program clash is refused.
    assert not core.apply_hints([Priority(session_id="ghost", program_age_s=1.0)])[0].ok
    assert not core.apply_hints([Priority(session_id="moved", program_id="other", program_age_s=1.0)])[0].ok
    assert core.apply_hints([Release(program_id="po")])[0].ok and "moved" not in core.kv.sessions


def _admission_node(fraction: float | None) -> tuple[EngineCore, random.Random]:
    # 24 blocks x 16 tokens.  Program "pa" has run a first turn here (240 tokens, 15 blocks, parked and
    # unpinned: any start could take its blocks).
    core = make_core(blocks=24, admit_fraction=fraction)  # type: ignore[arg-type]
    rng = random.Random(12)
    assert core.apply_hints([Priority(session_id="a", program_id="pa", program_age_s=0.0)])[0].ok
    core.submit(rand_tokens(rng, 240), 1, session_id="a", program_id="pa")
    core.run_until_idle()
    return core, rng


@pytest.mark.parametrize("fraction", [None, 1.0])
def test_program_admission_keeps_a_new_program_out_until_the_active_ones_leave_room(
    fraction: float | None,
) -> None:
    # A plain request decodes (not a program: never held back, 8 blocks at most); program "pb"'s 200-token
    # first turn (13 blocks) arrives.  Active contexts 15 + 13 > 24 blocks: with the rule "pb" waits and
    # "pa" keeps its context; without it "pb" takes "pa"'s blocks.  Once "pa" is released "pb" starts.
    core, rng = _admission_node(fraction)
    runner = core.submit(rand_tokens(rng, 20), 100, session_id="plain", program_id="plain")
    core.step()
    assert core.apply_hints([Priority(session_id="b", program_id="pb", program_age_s=0.0)])[0].ok
    b = core.submit(rand_tokens(rng, 200), 1, session_id="b", program_id="pb")
    for _ in range(3):
        core.step()
    held = fraction is not None
    assert (b.first_token_s is None) is held
    assert (len(core.kv.sessions["a"].block_ids) == 15) is held
    assert runner.output  # the plain request went on meanwhile
    assert core.apply_hints([Release(program_id="pa")])[0].ok
    core.step()
    core.step()
    assert b.first_token_s is not None
    metrics = EngineMetrics(core).registry
    holds = metrics.get_sample_value("hintflow_admission_holds_total", {"model_name": core.model_name})
    fits = metrics.get_sample_value("hintflow_admissions_total", {"model_name": core.model_name, "reason": "fit"})
    assert (holds, fits) == ((3.0, 2.0) if held else (0.0, 0.0))  # a hold per step; "pa" and "pb" fit
    core.run_until_idle()
    core.check_invariants()


def test_program_admission_is_work_conserving_and_forgets_idle_programs() -> None:
    # Nothing else runs: "pb" starts at once although it does not fit beside "pa" (an idle node admits).
    core, rng = _admission_node(1.0)
    assert core.apply_hints([Priority(session_id="b", program_id="pb", program_age_s=0.0)])[0].ok
    b = core.submit(rand_tokens(rng, 200), 1, session_id="b", program_id="pb")
    core.step()
    assert b.first_token_s is not None
    core.run_until_idle()
    # Beside a decode "pc" waits while "pa" and "pb" are active (15 + 13 + 13 > 24 blocks); once both
    # have been idle past admit_horizon_s (5 s) they no longer hold a place, and "pc" starts.
    core.submit(rand_tokens(rng, 20), 100, session_id="plain", program_id="plain")
    core.step()
    assert core.apply_hints([Priority(session_id="c", program_id="pc", program_age_s=0.0)])[0].ok
    c = core.submit(rand_tokens(rng, 200), 1, session_id="c", program_id="pc")
    core.step()
    core.step()
    assert c.first_token_s is None
    clock = core.clock
    assert isinstance(clock, VirtualClock)
    clock.advance_to(clock.now() + 6.0)
    core.step()
    core.step()
    assert c.first_token_s is not None
    core.run_until_idle()
    core.check_invariants()


def test_program_admission_holds_only_a_programs_first_turn_on_the_node() -> None:
    # "pa" ran here and has been idle past the horizon (not in flight); "pb" then ran (13 blocks, in
    # flight).  Beside a decode, a new session of "pa" (a sub-agent) goes at once although 13 + 13 > 24
    # blocks, while a first turn of the new program "pc" of the same size waits: only a program's start is
    # held, as on the vLLM node (a program it has started and not seen released is not new).
    core, rng = _admission_node(1.0)
    clock = core.clock
    assert isinstance(clock, VirtualClock)
    clock.advance_to(clock.now() + 6.0)
    assert core.apply_hints([Priority(session_id="b", program_id="pb", program_age_s=0.0)])[0].ok
    core.submit(rand_tokens(rng, 200), 1, session_id="b", program_id="pb")
    core.run_until_idle()
    core.submit(rand_tokens(rng, 20), 100, session_id="plain", program_id="plain")
    core.step()
    assert core.apply_hints([Priority(session_id="a2", program_id="pa", program_age_s=6.0)])[0].ok
    assert core.apply_hints([Priority(session_id="c", program_id="pc", program_age_s=0.0)])[0].ok
    sub = core.submit(rand_tokens(rng, 200), 1, session_id="a2", program_id="pa")
    c = core.submit(rand_tokens(rng, 200), 1, session_id="c", program_id="pc")
    for _ in range(3):
        core.step()
    assert sub.first_token_s is not None
    assert c.first_token_s is None
    assert core.scheduler.admit_stats["held"] >= 3
    core.run_until_idle()
    core.check_invariants()


@pytest.mark.parametrize("resumes_are_warm", [False, True])
def test_a_resume_that_recomputes_is_capped_as_cold_unless_resumes_are_warm(resumes_are_warm: bool) -> None:
    # Session "a" ran a 40-token turn; a 1,000-token plain prompt then took its blocks.  Its next turn
    # must recompute all 45 tokens while a plain decode shares the step: as a cold prefill it gets 16
    # tokens a step (three steps to its first token); as a resume with resumes_are_warm, one step.
    core = make_core(
        blocks=64, max_num_batched_tokens=64, cold_prefill_budget_tokens=16, warm_threshold_tokens=8,
        resumes_are_warm=resumes_are_warm,
    )  # fmt: skip
    rng = random.Random(13)
    p1 = rand_tokens(rng, 40)
    first = core.submit(p1, 1, session_id="a", program_id="pa")
    core.run_until_idle()
    core.submit(rand_tokens(rng, 1000), 1, session_id="big", program_id="big")
    core.run_until_idle()
    core.submit(rand_tokens(rng, 8), 50, session_id="plain", program_id="plain")
    core.step()
    assert core.kv.sessions["a"].block_ids == []  # evicted
    resume = core.submit(p1 + first.output + rand_tokens(rng, 4), 1, session_id="a")
    steps = 0
    while resume.first_token_s is None:
        core.step()
        steps += 1
    assert steps == (1 if resumes_are_warm else 3)
    assert resume.num_recomputed_tokens == 40
    core.run_until_idle()
    core.check_invariants()


def _two_new_programs(admit_fraction: float, seed: int, a: tuple[int, int], b: tuple[int, int]) -> tuple[EngineCore, Request, Request]:
    """A 64-block node stepping 64 tokens with program admission at ``admit_fraction``, and the first turns
    of programs "pa" and "pb" (prompt tokens, new tokens each), both started now."""
    core = make_core(blocks=64, max_num_batched_tokens=64, admit_fraction=admit_fraction)  # type: ignore[arg-type]
    rng = random.Random(seed)
    for sid in ("a", "b"):
        assert core.apply_hints([Priority(session_id=sid, program_id=f"p{sid}", program_age_s=0.0)])[0].ok
    ra = core.submit(rand_tokens(rng, a[0]), a[1], session_id="a", program_id="pa")
    rb = core.submit(rand_tokens(rng, b[0]), b[1], session_id="b", program_id="pb")
    return core, ra, rb


def test_program_admission_counts_a_running_first_turn_at_its_full_length() -> None:
    # 64 blocks, 64 tokens a step.  "pa"'s 600-token first turn (38 blocks) prefills alone for nine steps;
    # at the tenth, 24 tokens are left and "pb"'s 430-token first turn (27 blocks) is looked at.  "pa"
    # counts at its full length, as vLLM's rule counts a live request: 38 + 27 > 64 and "pb" waits (by
    # the 576 tokens computed so far it would fit: 36 + 27).  Once "pa" is done nothing runs: "pb" starts.
    core, a, b = _two_new_programs(1.0, 14, (600, 1), (430, 1))
    for _ in range(10):
        core.step()
    assert a.first_token_s is not None and b.first_scheduled_s is None
    assert core.scheduler.admit_stats["held"] == 1
    core.run_until_idle()
    assert b.output and core.scheduler.admit_stats["idle"] == 1
    core.check_invariants()


def test_a_first_turn_let_through_but_kept_waiting_by_memory_is_counted_once() -> None:
    # "pa" runs a 1,000-token turn (63 of 64 blocks) and decodes; at each decode step "pb"'s first turn is
    # let through by program admission (fraction 10: everything fits), yet memory keeps it waiting until
    # "pa" is done.  It is one admission, counted when it is admitted, not once per step.
    core, a, b = _two_new_programs(10.0, 15, (1000, 6), (400, 1))
    steps = 0
    while b.first_scheduled_s is None:
        core.step()
        steps += 1
    assert a.finished_s is not None and steps > 16  # it waited through pa's prefill and decodes
    core.run_until_idle()
    stats = core.scheduler.admit_stats
    assert stats["fit"] == 2 and stats["held"] == 0 and stats["idle"] == 0  # pa, then pb: once each
    core.check_invariants()


def test_a_pin_says_whether_it_holds_blocks_now_later_or_not_at_all() -> None:
    """The acknowledgement tells a placed pin from one that holds nothing: the orchestrator counts only
    the first as a pin placed (an OK pin on a context already evicted kept nothing)."""
    core = make_core(blocks=24)
    rng = random.Random(6)
    core.submit(rand_tokens(rng, 100), 5, session_id="running", program_id="a")
    core.step()  # its prefill ran: the turn is decoding, not parked
    [while_running] = core.apply_hints([Pin(session_id="running", ttl_s=60.0)])
    assert while_running.ok and while_running.deferred and while_running.pinned_blocks == 0 and while_running.holds
    core.run_until_idle()
    [parked] = core.apply_hints([Pin(session_id="running", ttl_s=60.0)])
    assert parked.pinned_blocks > 0 and not parked.deferred and parked.holds
    core.submit(rand_tokens(rng, 100), 1, session_id="gone", program_id="b")
    core.run_until_idle()
    for i in range(4):  # the unpinned context leaves the pool
        core.submit(rand_tokens(rng, 150), 1, session_id=f"load{i}")
        core.run_until_idle()
    [empty] = core.apply_hints([Pin(session_id="gone", ttl_s=60.0)])
    assert empty.ok and empty.pinned_blocks == 0 and not empty.deferred and not empty.holds
    core.check_invariants()


@pytest.mark.parametrize("warm_first", [True, False])
def test_a_warm_resume_goes_ahead_of_an_older_programs_cold_turn_unless_warm_first_is_off(warm_first: bool) -> None:
    # One seat: the first turn admitted is the one the queue rule puts first. The older program's turn is a
    # cold 600-token prompt; the younger one's resume has its 40-token context cached and adds 4 tokens.
    core = make_core(max_num_seqs=1, warm_first=warm_first)  # type: ignore[arg-type]
    rng = random.Random(21)
    core.submit(rand_tokens(rng, 8), 1, session_id="old", program_id="old")
    core.run_until_idle()
    p1 = rand_tokens(rng, 40)
    first = core.submit(p1, 1, session_id="young", program_id="young")
    core.run_until_idle()
    cold = core.submit(rand_tokens(rng, 600), 1, session_id="old-2", program_id="old")
    warm = core.submit(p1 + first.output + rand_tokens(rng, 4), 1, session_id="young")
    core.step()
    assert (warm.admitted, cold.admitted) == ((True, False) if warm_first else (False, True))
    core.run_until_idle()
    assert warm.num_recomputed_tokens == 0 and cold.num_cached_tokens == 0
    core.check_invariants()


@pytest.mark.parametrize("evict_queued", [False, True])
def test_a_queued_turns_context_is_evicted_last_unless_evict_queued(evict_queued: bool) -> None:
    # "b" ran first, then "a": LRU would take b's context first. b's next turn waits behind a long decode
    # (one seat) whose growth evicts: the embedded node keeps the queued turn's context while a parked one
    # is left; with evict_queued (vLLM's prefix cache: a queued request holds nothing) b's goes first.
    ex = make_torch_executor(num_device_blocks=12)
    core = EngineCore(ex, clock=VirtualClock(), scheduler_config=SchedulerConfig(max_num_seqs=1),
                      evict_queued=evict_queued)  # fmt: skip
    bs = core.block_size
    rng = random.Random(22)
    pb, pa = rand_tokens(rng, 3 * bs), rand_tokens(rng, 3 * bs)
    rb = core.submit(pb, 1, session_id="b", program_id="b")
    core.run_until_idle()
    core.submit(pa, 1, session_id="a", program_id="a")
    core.run_until_idle()
    core.submit(rand_tokens(rng, 8), 7 * bs, session_id="long", program_id="long")  # 8 blocks of 12: evicts 2
    core.step()
    resume = core.submit(pb + rb.output + rand_tokens(rng, 2), 1, session_id="b")
    core.run_until_idle()
    # two blocks evicted: b's last two (LRU) with evict_queued, else a's (the parked one)
    assert resume.num_cached_tokens == (1 if evict_queued else 3) * bs
    # b's context was whole when its turn arrived: what went, went while it queued (_lost_context)
    assert core.kv.stats.lost_by == ({"queued": 2 * bs} if evict_queued else {})
    core.check_invariants()
