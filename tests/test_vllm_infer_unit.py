"""Engine-side hint inference (``engine_adapter.vllm_backend._infer``) on a fake vLLM block pool.

No vLLM needed: the session book and the inference only duck-type vLLM's ``BlockPool`` (``touch``,
``free_blocks``, ``free_block_queue``), so these run in the main environment on a virtual clock and
pin down the rules; tests/test_vllm_infer.py checks the same against a real server.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from engine_adapter.vllm_backend._infer import SILENT_FACTOR, HintInference, infer_enabled
from engine_adapter.vllm_backend._sessions import SessionBook


@dataclass(eq=False)
class Blk:
    block_id: int
    block_hash: object = None
    ref_cnt: int = 1
    is_null: bool = False


class Queue:
    def __init__(self) -> None:
        self.items: list[Blk] = []

    def remove(self, b: Blk) -> None:
        self.items.remove(b)

    def prepend_n(self, bs: list[Blk]) -> None:
        self.items[:0] = bs

    def append_n(self, bs: list[Blk]) -> None:
        self.items.extend(bs)


class Pool:
    def __init__(self) -> None:
        self.free_block_queue = Queue()

    def touch(self, bs: Iterable[Blk]) -> None:
        for b in bs:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, bs: Iterable[Blk]) -> None:
        for b in bs:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_block_queue.append_n([b])


_ids = itertools.count()


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _setup(**kw: float) -> tuple[SessionBook, HintInference, Clock]:
    clock = Clock()
    book = SessionBook(Pool(), 100, pin_budget_fraction=0.5, clock=clock)
    inf = HintInference(book, reload_s_per_token=0.1, **kw)  # type: ignore[arg-type]
    return book, inf, clock


def _turn(book: SessionBook, inf: HintInference, sid: str, rid: str, extra: dict, n_blocks: int = 4) -> None:
    """One turn of ``sid``: arrives, runs, finishes with ``n_blocks`` hashed blocks."""
    s = book.session(sid, str(extra.get("program_id", "")))
    book.on_request_added(s, rid)
    inf.on_request(s, extra)
    book.on_admitted(s, rid)
    inf.on_turn_end(s, n_blocks * 128)
    blocks = [Blk(next(_ids), block_hash=(sid, rid, i)) for i in range(n_blocks)]
    book.on_request_finished(s, rid, blocks)
    inf.after_turn_end(s)


def test_a_finished_turn_is_pinned_for_the_continuum_ttl_and_the_pause_is_measured() -> None:
    book, inf, clock = _setup()
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "edit"})
    s = book.sessions["p"]
    assert len(s.held) == 4 and inf.inferred_pins == 1
    # cold start: Exp(1 s) tools, benefit 0.1 s/token x 512 tokens = 51.2 s -> tau = ln(51.2) ~ 3.9 s
    assert s.pin_deadline_s is not None and 3.0 < s.pin_deadline_s < 5.5
    clock.t = 2.5
    _turn(book, inf, "p", "r2", {"program_id": "p", "tool": "test"})
    assert inf.pauses.num_samples("edit") == 1
    assert inf.pauses._tools["edit"].support().tolist() == [2.5]  # end of turn 1 to arrival of turn 2
    assert inf.programs["p"].sessions["p"].tool == "test"


def test_a_pin_that_runs_out_in_its_pause_is_decided_again_on_the_pause_so_far() -> None:
    book, inf, clock = _setup()
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "edit"})
    s = book.sessions["p"]
    first = s.pin_deadline_s
    assert first is not None
    clock.t = first + 0.01
    book.expire(inf.renewal_s)
    # Exp(1 s) is memoryless: the rest of the pause is priced as the whole was, so the lease is renewed
    assert s.pin_deadline_s is not None and s.pin_deadline_s - clock.t > 3.0 and len(s.held) == 4
    assert (book.stats.pin_renewals, book.stats.pin_expiries, inf.inferred_renewals) == (1, 0, 1)
    assert inf.programs["p"].sessions["p"].lease_s > first  # (the silence that releases it follows)
    # past the cold-start default's 99th percentile (4.6 s) the pause is not taken as that tool's: let go
    clock.t = s.pin_deadline_s + 0.01
    book.expire(inf.renewal_s)
    assert s.pin_deadline_s is None and not s.held and book.num_pinned_blocks == 0
    assert (book.stats.pin_renewals, book.stats.pin_expiries) == (1, 1)


def test_only_an_inferred_pin_in_its_pause_is_renewed() -> None:
    book, inf, clock = _setup(defer_s=10.0)
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "edit"})
    inf.note_explicit("q")  # the orchestrator speaks for q: its pin is its own, not this inference's
    _turn(book, inf, "q", "r2", {"program_id": "q", "tool": "edit"})
    book.set_pin(book.sessions["q"], 4.0)
    clock.t = 5.0
    book.expire()  # no renewal asked for (HINTFLOW_INFER_RENEW=0): p's lease runs out as before
    assert not book.sessions["p"].held and not book.sessions["q"].held
    assert (book.stats.pin_renewals, book.stats.pin_expiries) == (0, 2)
    # the same with renewal: q's explicit pin is let go, p's inferred one renewed
    book, inf, clock = _setup(defer_s=10.0)
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "edit"})
    inf.note_explicit("q")
    _turn(book, inf, "q", "r2", {"program_id": "q", "tool": "edit"})
    book.set_pin(book.sessions["q"], 4.0)
    clock.t = 4.2
    book.expire(inf.renewal_s)
    assert len(book.sessions["p"].held) == 4 and not book.sessions["q"].held
    assert (book.stats.pin_renewals, book.stats.pin_expiries) == (1, 1)
    # a session whose next turn is in flight is not in a pause: its lease is not renewed
    s = book.sessions["p"]
    book.on_request_added(s, "r3")
    inf.on_request(s, {"program_id": "p", "tool": "edit"})
    assert inf.renewal_s(s) == 0.0


def test_program_fcfs_dates_a_program_by_its_first_request() -> None:
    book, inf, clock = _setup()
    _turn(book, inf, "old", "r1", {"program_id": "old"})
    clock.t = 5.0
    _turn(book, inf, "new", "r2", {"program_id": "new"})
    clock.t = 6.0
    _turn(book, inf, "old", "r3", {"program_id": "old"})
    assert book.sessions["old"].program_start_s == 0.0
    assert book.sessions["new"].program_start_s == 5.0


def test_last_turn_releases_the_program_and_feeds_eta() -> None:
    book, inf, _ = _setup()
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "t"})
    assert book.num_pinned_blocks == 4
    _turn(book, inf, "p", "r2", {"program_id": "p", "is_last_turn": True})
    assert book.num_pinned_blocks == 0 and "p" not in book.sessions and "p" not in inf.programs
    assert inf.inferred_releases == 1 and inf.rule._num_programs == 1


def test_explicit_hints_take_precedence() -> None:
    book, inf, clock = _setup(defer_s=10.0)
    inf.note_explicit("p")
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "t"})
    assert book.num_pinned_blocks == 0 and inf.inferred_pins == 0
    clock.t = 11.0  # the orchestrator went quiet: inference takes over again
    _turn(book, inf, "p", "r2", {"program_id": "p", "tool": "t"})
    assert book.num_pinned_blocks == 4
    inf.note_explicit("p")  # ...until it speaks again: the inferred pin goes, its own hints decide
    assert book.num_pinned_blocks == 0


def test_a_program_silent_far_past_its_lease_is_released() -> None:
    book, inf, clock = _setup(silent_min_s=5.0)
    _turn(book, inf, "p", "r1", {"program_id": "p", "tool": "t"})
    lease = inf.programs["p"].sessions["p"].lease_s
    clock.t = max(5.0, SILENT_FACTOR * lease) - 0.1
    inf.sweep()
    assert "p" in book.sessions
    clock.t += 1.2  # past the threshold (and the sweep's one-second period)
    book.expire()
    inf.sweep()
    assert "p" not in book.sessions and inf.inferred_releases == 1


def test_measured_reload_cost_follows_prefill_steps() -> None:
    book = SessionBook(Pool(), 100, clock=Clock())
    inf = HintInference(book)
    for _ in range(100):
        inf.observe_step(2000, 0.5)  # 0.25 ms per token
        inf.observe_step(8, 0.5)  # decode steps say nothing about prefill
    assert abs(inf.s_per_token - 2.5e-4) < 1e-6
    assert abs(inf.prefill_reload_s(4000) - 1.0) < 1e-2


def test_switch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HINTFLOW_INFER_HINTS", "0")
    assert not infer_enabled()
    monkeypatch.setenv("HINTFLOW_INFER_HINTS", "1")
    assert infer_enabled()
    monkeypatch.delenv("HINTFLOW_INFER_HINTS")
    assert infer_enabled()


def test_a_prefill_backlog_starts_pins_before_any_queueing_is_measured() -> None:
    """Continuum's T is 0 until evicted turns have queued; the engine's backlog is T's floor here."""
    backlog = [0]
    book = SessionBook(Pool(), 100, pin_budget_fraction=0.5, clock=Clock())
    inf = HintInference(book, reload_s_per_token=1e-4, backlog_tokens=lambda: backlog[0])
    assert inf.rule.queue_delay_s == 0.0
    _turn(book, inf, "a", "r1", {"program_id": "a", "tool": "edit"})
    assert book.num_pinned_blocks == 0  # B = 0.05 s of reload < the Exp(1 s) pause: no pin pays
    backlog[0] = 50_000  # 5 s of prefill already queued: a re-prefilled turn would wait that long
    assert abs(inf.rule.queue_delay_s - 5.0) < 1e-9
    _turn(book, inf, "b", "r2", {"program_id": "b", "tool": "edit"})
    assert book.num_pinned_blocks == 4 and inf.inferred_pins == 1


def test_interleaved_sessions_of_one_program_each_measure_their_own_pause() -> None:
    """A multi-agent program's workers run at once: a pause runs from a session's own turn end to its own
    next arrival, with its own tool. One program-wide record paired a's turn end with b's arrival (0.5 s
    of "grep"), then b's end with a's return (1.5 s of "test")."""
    book, inf, clock = _setup()
    prog = {"program_id": "p"}
    _turn(book, inf, "p/a", "a1", {**prog, "tool": "grep"})  # t = 0: a's turn ends, its grep runs
    clock.t = 0.5
    _turn(book, inf, "p/b", "b1", {**prog, "tool": "test"})  # b's first turn ends no pause
    inf.on_admitted(book.sessions["p/b"], 3.0, kept=False)  # a first turn: no evicted context waited
    clock.t = 2.0
    _turn(book, inf, "p/a", "a2", {**prog, "tool": "edit"})  # a's grep took 2 s
    clock.t = 5.0
    _turn(book, inf, "p/b", "b2", {**prog, "tool": "edit"})  # b's test took 4.5 s
    inf.on_admitted(book.sessions["p/b"], 3.0, kept=False)  # a returning turn whose context was evicted
    assert inf.pauses._tools["grep"].support().tolist() == [2.0]
    assert inf.pauses._tools["test"].support().tolist() == [4.5]
    assert "edit" not in inf.pauses._tools  # both edits still run
    assert (inf.rule._queue_delays.num_waits, inf.rule._queue_delays.mean_s) == (1, 3.0)  # b's second turn only
    assert book.sessions["p/a"].program_start_s == book.sessions["p/b"].program_start_s == 0.0  # program FCFS


def test_a_program_is_released_only_when_every_session_is_silent_past_its_own_lease() -> None:
    """One program-wide lease was the latest turn's: b's short one released a while a's tool still ran."""
    book, inf, clock = _setup(silent_min_s=1.0)
    prog = {"program_id": "p"}
    _turn(book, inf, "p/a", "a1", prog, n_blocks=4)  # 512 tokens: lease ln(51.2) = 3.9 s
    clock.t = 1.0
    _turn(book, inf, "p/b", "b1", prog, n_blocks=1)  # 128 tokens: lease ln(12.8) = 2.5 s
    a_deadline, b_deadline = book.sessions["p/a"].pin_deadline_s, book.sessions["p/b"].pin_deadline_s
    assert a_deadline is not None and b_deadline is not None
    lease_a, lease_b = a_deadline - 0.0, b_deadline - 1.0  # the pins' leases
    assert lease_a > lease_b > 0
    clock.t = 1.0 + SILENT_FACTOR * lease_b + 0.5  # b silent past its lease, a's tool may still run
    assert clock.t < SILENT_FACTOR * lease_a
    book.expire()
    inf.sweep()
    assert {"p/a", "p/b"} <= set(book.sessions) and inf.inferred_releases == 0
    clock.t = SILENT_FACTOR * lease_a + 0.1  # now a too
    book.expire()
    inf.sweep()
    assert not {"p/a", "p/b"} & set(book.sessions) and inf.inferred_releases == 1


def test_with_a_host_tier_pins_are_priced_by_the_copy_back_alone() -> None:
    """A node with a host tier: an unpinned context is copied back, not re-prefilled, and T is left out, so
    even a deep prefill backlog does not make a pin pay (the same turn pins without the host tier)."""
    backlog = [50_000]
    book = SessionBook(Pool(), 100, pin_budget_fraction=0.5, clock=Clock())
    kw: dict = {"reload_s_per_token": 1e-4, "backlog_tokens": lambda: backlog[0]}
    inf = HintInference(book, host_reload_s_per_token=2e-6, **kw)
    assert inf.rule.queue_delay_s == 0.0
    # what the node logs as T: the one that prices the share the tier does not give back (the backlog floor
    # here), not the 0 of the share it does (the log said T=0.00s with every tier until 2026-12-07)
    assert inf.priced_queue_delay_s == pytest.approx(50_000 * 1e-4)
    _turn(book, inf, "a", "r1", {"program_id": "a", "tool": "edit"})
    assert book.num_pinned_blocks == 0 and inf.inferred_pins == 0
    book2 = SessionBook(Pool(), 100, pin_budget_fraction=0.5, clock=Clock())
    inf2 = HintInference(book2, **kw)
    _turn(book2, inf2, "a", "r1", {"program_id": "a", "tool": "edit"})
    assert book2.num_pinned_blocks == 4


def test_a_host_tier_that_gives_nothing_back_prices_pins_as_no_host_tier_would() -> None:
    """The short host tier of a real run: contexts were overwritten on the host before their turns came
    back (0.3% external hits). Once returning turns show that, a lost context is priced as a re-prefill
    queued behind the backlog, and the turn that did not pin before pins now."""
    book = SessionBook(Pool(), 100, pin_budget_fraction=0.5, clock=Clock())
    inf = HintInference(book, host_reload_s_per_token=2e-6, reload_s_per_token=1e-4,
                        backlog_tokens=lambda: 50_000)  # fmt: skip
    assert inf.host_hit_fraction() == 1.0  # a host tier works until seen not to
    inf.observe_host_reload(2000, 500, 1500)  # everything not on the device came from the host
    assert inf.host_hit_fraction() == 1.0
    _turn(book, inf, "a", "r1", {"program_id": "a", "tool": "edit"})
    assert book.num_pinned_blocks == 0
    for _ in range(20):
        inf.observe_host_reload(2000, 0, 0)  # nothing came back
    assert inf.host_hit_fraction() < 0.1
    inf.observe_host_reload(2000, 2000, 0)  # all on the device: says nothing about the host
    _turn(book, inf, "b", "r2", {"program_id": "b", "tool": "edit"})
    assert book.num_pinned_blocks == 4 and inf.inferred_pins == 1
