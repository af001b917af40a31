"""Context integrity: every block a context claims holds that context's KV, on every path.

A content-tracking executor records, per block slot, the token whose KV it holds (forward passes write
their tokens, tier copies move them, export/import carry them as bytes) and checks on every step that a
sequence's cached positions hold exactly its tokens.  ``deep_check`` then holds the KV manager to what it
claims between steps.  A randomized mix of operations runs under it in five configurations, and one
focused test per defect found by review pins each fix down.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest

from engine_adapter import (
    EngineCore,
    EngineError,
    InvalidArgument,
    KVCacheManager,
    KVLayout,
    ModeledExecutor,
    Request,
    RequestState,
    ResourceExhausted,
    ScheduledBatch,
    SchedulerConfig,
    SessionState,
    StepOutput,
    VirtualClock,
    load_cost_model,
    make_torch_executor,
)
from hints import EvictionOrder, NextUse, Pin, Prefetch, Priority, Release, cache_state_to_proto
from tests.engine_support import deadline_scheduler_config, release_everything

Tier = Literal["device", "host"]
VOCAB = 500


class TrackingExecutor(ModeledExecutor):
    """A modeled executor whose blocks hold token ids instead of KV: slot ``[b, i]`` of a tier is the token
    whose KV block ``b`` holds at offset ``i`` (-1: never written).  Every step checks that each sequence's
    cached positions hold exactly its tokens; mismatches collect in ``errors``."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int) -> None:
        cm = load_cost_model("cpu-tiny").model_copy(update={"block_size": block_size})
        super().__init__(
            cm,
            num_device_blocks,
            num_host_blocks,
            vocab_size=VOCAB,
            max_model_len=4096,
            layout=KVLayout(2, 2, 8, block_size, "float16"),
        )
        self.core: EngineCore | None = None  # to read each sequence's tokens (set by make_core)
        self.slots: dict[Tier, npt.NDArray[np.int64]] = {
            "device": np.full((num_device_blocks, block_size), -1, np.int64),
            "host": np.full((num_host_blocks, block_size), -1, np.int64),
        }
        self.errors: list[str] = []
        # Runs first in every step (a test's slow forward pass or failing device).
        self.before_execute: Callable[[ScheduledBatch], None] | None = None

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if self.before_execute is not None:
            self.before_execute(batch)
        out = super().execute(batch)
        bs = self.layout.block_size
        for op in batch.copies:  # in list order, as the executor runs them
            if op.kind == "d2h":
                self.slots["host"][op.dst] = self.slots["device"][op.src]
            else:
                self.slots["device"][op.dst] = self.slots["host"][op.src]
        for seq in batch.seqs:
            req = self.core.scheduler.requests.get(seq.request_id) if self.core is not None else None
            if req is not None:
                toks = req.tokens
                for p in range(seq.start_pos):
                    have = int(self.slots["device"][seq.block_ids[p // bs], p % bs])
                    if have != toks[p]:
                        self.errors.append(
                            f"{seq.request_id} pos {p}: cached slot holds {have}, token is {toks[p]} "
                            f"(start_pos {seq.start_pos})"
                        )
                        break
            for i, t in enumerate(seq.token_ids):
                p = seq.start_pos + i
                self.slots["device"][seq.block_ids[p // bs], p % bs] = t
        return out

    def read_blocks(self, tier: Tier, block_ids: list[int]) -> bytes:
        """In ``kv_shape``'s layer-major layout, as every executor's: a block's token ids stand in for its
        first layer's K, so bytes joined or split along the wrong axis land in the wrong block."""
        lead, per = self._layout_dims()
        out = np.zeros((lead, len(block_ids), per), np.uint8)
        for i, b in enumerate(block_ids):
            raw = np.frombuffer(self.slots[tier][b].tobytes(), np.uint8)
            out[0, i, : raw.size] = raw
        return out.tobytes()

    def write_blocks(self, tier: Tier, block_ids: list[int], data: bytes) -> None:
        lead, per = self._layout_dims()
        arr = np.frombuffer(data, np.uint8).reshape(lead, len(block_ids), per)
        width = 8 * self.layout.block_size
        for i, b in enumerate(block_ids):
            self.slots[tier][b] = np.frombuffer(arr[0, i, :width].tobytes(), np.int64)

    def _layout_dims(self) -> tuple[int, int]:
        lead = self.layout.num_layers * 2
        return lead, self.layout.block_nbytes // lead


def make_core(
    dev: int = 24, host: int = 8, bs: int = 4, cfg: SchedulerConfig | None = None, **engine: Any
) -> tuple[EngineCore, TrackingExecutor, VirtualClock]:
    ex = TrackingExecutor(dev, host, bs)
    clock = VirtualClock()
    cfg = cfg or SchedulerConfig(max_num_batched_tokens=64, cold_prefill_budget_tokens=16, warm_threshold_tokens=8)
    core = EngineCore(ex, clock=clock, scheduler_config=cfg, **engine)
    ex.core = core
    return core, ex, clock


def deep_check(core: EngineCore, ex: TrackingExecutor) -> None:
    """Raise AssertionError unless: the core's invariants hold; every parked session's device and host
    positions hold its tokens (counting copies still pending); every prefix-index entry matches its
    block's contents; no session has pinned blocks without a lease; no parked session has a lease whose
    expiry is not scheduled; and the executor never saw wrong cached KV."""
    core.check_invariants()
    kv = core.kv
    bs = kv.block_size
    slots = {tier: a.copy() for tier, a in ex.slots.items()}
    for op in kv.pending_copies:  # what the next step's copies will have done before anything reads
        if op.kind == "d2h":
            slots["host"][op.dst] = slots["device"][op.src]
        else:
            slots["device"][op.dst] = slots["host"][op.src]
    for s in kv.sessions.values():
        if s.state is not SessionState.PARKED:
            continue
        nd = s.num_device_tokens
        for p in range(nd):
            have = int(slots["device"][s.block_ids[p // bs], p % bs])
            assert have == s.token_ids[p], (
                f"parked {s.session_id} device pos {p}: slot {have} != token {s.token_ids[p]} "
                f"(device tokens {nd})"
            )
        for p in range(nd, nd + s.num_host_tokens):
            hb = s.host_block_ids[p // bs - len(s.block_ids)]
            have = int(slots["host"][hb, p % bs])
            assert have == s.token_ids[p], f"parked {s.session_id} host pos {p}: slot {have} != token {s.token_ids[p]}"
        assert len(s.block_hashes) <= len(s.block_ids), f"{s.session_id}: more hashes than blocks"
    for bid in kv.device._index.values():
        b = kv.device.blocks[bid]
        if b.token_key is not None:
            have_key = tuple(int(t) for t in slots["device"][bid])
            assert have_key == b.token_key, (
                f"prefix index: block {bid} is indexed as {b.token_key} but holds {have_key} (ref {b.ref_cnt})"
            )
    for s in kv.sessions.values():
        assert not (s.pinned_blocks and s.pin_deadline_s is None), f"{s.session_id}: pinned blocks without a lease"
        assert not (
            s.state is SessionState.PARKED
            and s.pin_deadline_s is not None
            and not kv.leases.scheduled(s)
        ), f"{s.session_id}: parked with a lease to {s.pin_deadline_s} (now {kv.clock.now()}) but no expiry scheduled"
    assert not ex.errors, f"executor saw wrong cached KV: {ex.errors[:3]}"


# ---- randomized operations ---------------------------------------------------------------------------

SESSIONS = [f"s{i}" for i in range(6)]
PROGRAMS = {s: f"p{int(s[1:]) % 3}" for s in SESSIONS}
NUM_OPS = 120
NUM_SEEDS = 200  # per configuration: the whole file stays well under 30 s on two cores

CONFIGS: dict[str, dict[str, Any]] = {
    "host0": dict(host=0),
    "bighost": dict(host=40),
    "lru_noretain": dict(eviction_policy="lru", retain_contexts=False),
    "deadline": dict(cfg=deadline_scheduler_config()),
    "bs3_pin": dict(bs=3, dev=30, pin_budget_fraction=0.9),
}


def _random_op(
    rng: random.Random,
    core: EngineCore,
    clock: VirtualClock,
    base: list[int],
    hist: dict[str, list[int]],
    reqs: list[str],
    log: list[tuple[Any, ...]],
) -> None:
    """Do one random operation, noted in ``log`` before it runs (for the failure message)."""
    r = rng.random()
    if r < 0.3:
        sid = rng.choice(SESSIONS)
        s = core.kv.sessions.get(sid)
        if s is not None and s.state is not SessionState.PARKED:  # one turn at a time: step instead
            log.append(("step",))
            core.step()
            return
        h = hist.get(sid, list(base) if rng.random() < 0.6 else [])  # most start from a shared prefix
        if h and rng.random() < 0.15:
            h = h[: rng.randrange(len(h))]  # a history that diverges from what is cached
        prompt = (h + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))])[-60:]
        n_out = rng.randrange(1, 8)
        log.append(("submit", sid, len(prompt), n_out))

        def remember(req: Request, toks: list[int], done: bool, sid: str = sid, prompt: list[int] = prompt) -> None:
            if done:
                hist[sid] = prompt + req.output

        reqs.append(core.submit(prompt, n_out, session_id=sid, program_id=PROGRAMS[sid], on_event=remember).request_id)
    elif r < 0.55:
        n = rng.randrange(1, 5)
        log.append(("step", n))
        for _ in range(n):
            core.step()
    elif r < 0.62:
        sid, ttl = rng.choice(SESSIONS), rng.choice([0.0, 0.5, 2.0, 10.0])
        log.append(("pin", sid, ttl))
        core.apply_hints([Pin(session_id=sid, ttl_s=ttl)])
    elif r < 0.67:
        sid, at = rng.choice(SESSIONS), rng.uniform(0, 20)
        log.append(("order", sid, at))
        core.apply_hints([EvictionOrder(entries=[NextUse(session_id=sid, next_use_s=at)])])
    elif r < 0.72:
        sid, at = rng.choice(SESSIONS), rng.uniform(0, 2)
        log.append(("prefetch", sid, at))
        core.apply_hints([Prefetch(session_id=sid, at_s=at)])
    elif r < 0.75:
        sid, age = rng.choice(SESSIONS), rng.uniform(0, 50)
        log.append(("priority", sid, age))
        core.apply_hints([Priority(session_id=sid, program_id=PROGRAMS[sid], program_age_s=age)])
    elif r < 0.78:
        prog = rng.choice(sorted(set(PROGRAMS.values())))
        log.append(("release", prog))
        core.apply_hints([Release(program_id=prog)])
        for sid in SESSIONS:
            if PROGRAMS[sid] == prog:
                hist.pop(sid, None)
    elif r < 0.84 and reqs:
        rid = rng.choice(reqs)
        log.append(("abort", rid))
        core.abort(rid)
    elif r < 0.90:
        dt = rng.uniform(0, 3)
        log.append(("advance", dt))
        clock.advance(dt)
    elif r < 0.95:
        sid, release_after = rng.choice(SESSIONS), rng.random() < 0.5
        target = rng.choice(SESSIONS) if rng.random() < 0.5 else sid  # the same id, or another (its program's)
        log.append(("move", sid, release_after, target))
        blob = core.export_context(sid, release_after=release_after)
        blob.session_id, blob.program_id = target, PROGRAMS[target]
        core.import_context(blob)
    else:
        log.append(("tick",))
        core.kv.tick()


def run_random_ops(seed: int, config: dict[str, Any]) -> None:
    rng = random.Random(seed)
    core, ex, clock = make_core(**config)
    base = [rng.randrange(VOCAB) for _ in range(12)]  # a shared system prefix
    hist: dict[str, list[int]] = {}
    reqs: list[str] = []
    log: list[tuple[Any, ...]] = []

    def failure(k: int | str, what: str) -> AssertionError:
        return AssertionError(f"seed {seed}, op {k}: {what}\nlast ops: {log[-6:]}")

    for k in range(NUM_OPS):
        try:
            _random_op(rng, core, clock, base, hist, reqs, log)
        except EngineError as e:  # refusals are fine (unknown session, busy, no room): the state must hold
            log[-1] = (*log[-1], f"{type(e).__name__}: {e}")
        except Exception as e:
            raise failure(k, f"{type(e).__name__}: {e}") from e
        try:
            deep_check(core, ex)
        except AssertionError as e:
            raise failure(k, str(e)) from None
    core.run_until_idle()
    try:
        deep_check(core, ex)
        release_everything(core)
    except AssertionError as e:
        raise failure("end", str(e)) from None


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_operations_never_serve_or_keep_wrong_kv(config: str) -> None:
    """Any mix of turns (shared prefixes, diverging histories), steps, hints, aborts, expiries and context
    moves keeps every context's blocks holding its own tokens, and every block comes back at the end."""
    for seed in range(NUM_SEEDS):
        run_random_ops(seed, CONFIGS[config])


# ---- one test per defect found by review -------------------------------------------------------------


def test_host_reload_survives_the_offloads_its_own_allocation_causes() -> None:
    """A turn reloading host blocks whose device allocation offloads other contexts gets its own KV back:
    those offloads may not take its host blocks (its token equals a full recompute's)."""
    ex = make_torch_executor(num_device_blocks=8, num_host_blocks=3, block_size=4, num_layers=1, hidden_size=32,
                             num_heads=2, num_kv_heads=1, intermediate_size=32, max_model_len=512, seed=0)
    core = EngineCore(ex, clock=VirtualClock(), scheduler_config=SchedulerConfig(
        max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8))
    a1 = [(7 * i + 3) % 500 for i in range(16)]
    ra = core.submit(a1, 1, session_id="A")
    core.run_until_idle()
    core.submit([(11 * i + 5) % 500 for i in range(28)], 1, session_id="B")  # pushes 3 of A's 4 blocks to host
    core.run_until_idle()
    assert len(core.kv.sessions["A"].host_block_ids) == 3  # all of the host tier
    a2 = [*a1, *ra.output, 1, 2, 3]
    r2 = core.submit(a2, 1, session_id="A")
    core.run_until_idle()
    assert r2.num_host_hit_tokens == 12  # the reload happened (and B was offloaded to make room)
    assert r2.output[0] == int(ex.reference_logits(a2).argmax())
    core.check_invariants()


def test_release_then_preemption_keeps_the_turn_on_its_session() -> None:
    """Release while a turn runs, then that turn is preempted: it runs again on the same session, no block
    is orphaned, the node drains, and every block is free once everything is released."""
    core, ex, _ = make_core(dev=8, host=0, cfg=SchedulerConfig(
        max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8))
    rb = core.submit(list(range(100, 112)), 12, session_id="B", program_id="pB")  # 3 blocks, grows to 6
    ra = core.submit(list(range(1, 13)), 12, session_id="A", program_id="pA")  # arrives later: preempted first
    core.step()
    assert core.apply_hints([Release(program_id="pA")])[0].ok
    for _ in range(200):
        if core.step() is None:
            break
        core.check_invariants()
        held = {b for s in core.kv.sessions.values() for b in s.block_ids}
        orphans = [b.block_id for b in core.kv.device.blocks if b.ref_cnt and b.block_id not in held]
        assert not orphans, f"blocks held by no session in the table: {orphans}"
    assert core.scheduler.num_preemptions >= 1
    assert not core.scheduler.waiting and not core.scheduler.running
    assert ra.finish_reason == "length" and rb.finish_reason == "length"
    assert "A" not in core.kv.sessions  # the released program's session is forgotten once its turn is done
    deep_check(core, ex)
    release_everything(core)


def test_a_lapsed_pin_ends_when_its_queued_turn_is_aborted() -> None:
    """A pin whose lease lapses while the session's next turn is queued ends when that turn is aborted
    instead of admitted: no pinned blocks, no lease, and a new turn does not sort as pinned."""
    core, ex, clock = make_core(dev=24, host=0)
    r1 = core.submit(list(range(1, 17)), 1, session_id="A")
    core.run_until_idle()
    assert core.apply_hints([Pin(session_id="A", ttl_s=1.0)])[0].pinned_blocks == 4
    r2 = core.submit([*range(1, 17), *r1.output, 5], 1, session_id="A")  # queued: no step yet
    clock.advance(2.0)
    core.kv.tick()  # leaves a queued turn's lapsed lease to admission
    core.abort(r2.request_id)
    clock.advance(10.0)
    core.kv.tick()
    a = core.kv.sessions["A"]
    assert a.pinned_blocks == 0 and a.pin_deadline_s is None
    assert core.kv.num_pinned_blocks == 0
    assert core.kv.stats.pin_expiries == 1
    deep_check(core, ex)
    r3 = core.submit([9, 9, 9, 9], 1, session_id="A")
    assert r3.sort_key()[1] != 0  # not in the pinned band
    core.run_until_idle()
    deep_check(core, ex)


def test_a_failed_step_with_tier_copies_serves_no_unwritten_kv() -> None:
    """An executor failure in a step with tier copies: step() aborts the running requests and re-raises,
    the contexts the copies were for claim no block the copies were to fill, and the node keeps working
    (the next turn recomputes instead of reading unwritten KV)."""
    core, ex, _ = make_core(dev=8, host=8, cfg=SchedulerConfig(
        max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8))
    a1 = [(7 * i + 3) % 500 for i in range(16)]
    ra = core.submit(a1, 1, session_id="A")
    core.run_until_idle()
    core.submit([(11 * i + 5) % 500 for i in range(28)], 1, session_id="B")  # moves 3 of A's blocks to host
    core.run_until_idle()
    assert len(core.kv.sessions["A"].host_block_ids) == 3
    failed: list[ScheduledBatch] = []

    def fail_on_reload(batch: ScheduledBatch) -> None:
        if any(op.kind == "h2d" for op in batch.copies):
            failed.append(batch)
            raise RuntimeError("CUDA error: out of memory (simulated)")

    ex.before_execute = fail_on_reload
    r2 = core.submit([*a1, *ra.output, 1, 2, 3], 1, session_id="A")
    with pytest.raises(RuntimeError, match="simulated"):
        core.step()
    ex.before_execute = None
    assert failed and any(op.kind == "d2h" for op in failed[0].copies)  # reloads and offloads both lost
    assert r2.state is RequestState.FINISHED and r2.finish_reason == "abort"
    assert not core.scheduler.running
    deep_check(core, ex)
    r3 = core.submit([*a1, *ra.output, 1, 2, 3, 4], 1, session_id="A")
    core.run_until_idle()
    assert r3.output and r3.finish_reason == "length"
    deep_check(core, ex)  # (the executor checked the cached positions it was given)
    release_everything(core)


def test_import_refuses_odd_ids_and_a_foreign_program() -> None:
    """ImportContext holds ids to the protocol's rules (no control characters, at most 256 characters) and
    refuses a session of another program; the refused ids never reach the table, so CacheState with
    sessions keeps working."""
    core, ex, _ = make_core(dev=24, host=0)
    core.submit(list(range(1, 10)), 1, session_id="A", program_id="pA")
    core.run_until_idle()
    blob = core.export_context("A")
    for sid, pid in [("bad\nid", "pA"), ("x" * 300, "pA"), ("C", "p\x00"), ("A", "pB")]:
        with pytest.raises(InvalidArgument):
            core.import_context(dataclasses.replace(blob, session_id=sid, program_id=pid))
    assert sorted(core.kv.sessions) == ["A"] and sorted(core.kv.programs) == ["pA"]
    assert core.kv.sessions["A"].program_id == "pA"
    state = core.cache_state(include_sessions=True)
    assert [s.session_id for s in state.sessions] == ["A"]
    cache_state_to_proto(state)
    assert core.import_context(dataclasses.replace(blob, session_id="A2")) == (9, 3)  # good ids still pass
    deep_check(core, ex)


def test_import_larger_than_the_pool_is_refused_before_evicting_anything() -> None:
    """An import that needs more blocks than the whole device pool is refused with ResourceExhausted before
    anything is evicted or offloaded; neither it nor one refused for want of room right now leaves an
    empty session behind."""
    core, ex, _ = make_core(dev=24, host=8)
    for i in range(4):
        core.submit([(i * 31 + j) % 500 for j in range(16)], 1, session_id=f"s{i}")
        core.run_until_idle()
    kv = core.kv
    before = {sid: (list(s.block_ids), list(s.host_block_ids)) for sid, s in kv.sessions.items()}
    free = kv.device.num_free_blocks
    big = dataclasses.replace(core.export_context("s0"), session_id="big", token_ids=[7] * 120,
                              shape=ex.kv_shape(30), kv_data=bytes(30 * ex.layout.block_nbytes))
    with pytest.raises(ResourceExhausted):
        core.import_context(big)
    assert {sid: (list(s.block_ids), list(s.host_block_ids)) for sid, s in kv.sessions.items()} == before
    assert kv.device.num_free_blocks == free
    assert kv.stats.evicted_blocks == 0 and kv.stats.offloaded_blocks == 0 and kv.stats.dropped_host_blocks == 0
    deep_check(core, ex)
    # Room that running turns hold: refused too, and no empty session is left.
    busy = core.submit([(3 * j) % 500 for j in range(80)], 4, session_id="busy")
    core.step()
    assert busy.state is RequestState.RUNNING
    fits = dataclasses.replace(core.export_context("s1"), session_id="new", token_ids=[7] * 80,
                               shape=ex.kv_shape(20), kv_data=bytes(20 * ex.layout.block_nbytes))
    with pytest.raises(ResourceExhausted):
        core.import_context(fits)
    assert "new" not in kv.sessions
    core.run_until_idle()
    deep_check(core, ex)


def test_reserved_but_unwritten_blocks_are_let_go_at_park() -> None:
    """A turn aborted (or preempted) before it wrote all the blocks reserved for it keeps only the blocks
    its computed tokens fill, so eviction never offloads an empty block."""
    core, ex, _ = make_core(dev=16, host=16, cfg=SchedulerConfig(
        max_num_batched_tokens=64, cold_prefill_budget_tokens=8, warm_threshold_tokens=4))
    core.submit([1] * 4, 1, session_id="W")  # warm work keeps the cold-prefill cap active
    core.run_until_idle()
    ra = core.submit([(3 * i) % 500 for i in range(40)], 1, session_id="A")
    core.submit([5, 6], 30, session_id="W")  # a warm decode shares the step
    core.step()
    a = core.kv.sessions["A"]
    assert len(a.block_ids) > -(-len(a.token_ids) // 4)  # one capped chunk computed, every block reserved
    core.abort(ra.request_id)
    core.run_until_idle()
    assert len(a.block_ids) == -(-len(a.token_ids) // 4)
    offloaded = core.kv.stats.offloaded_blocks
    core.submit([(7 * i) % 500 for i in range(60)], 1, session_id="B")  # evicts A to the host
    core.run_until_idle()
    assert a.host_block_ids and len(a.host_block_ids) == -(-a.num_host_tokens // 4)
    assert core.kv.stats.offloaded_blocks - offloaded <= 2 + 8  # A's 2 blocks and W's at most
    deep_check(core, ex)


def test_request_id_is_bounded_and_printable() -> None:
    """A request id is echoed in every response: a 1 MB or non-printable one is refused, and nothing is
    queued for it."""
    core, _, _ = make_core()
    for rid in ["r" * 2**20, "bad\nid"]:
        with pytest.raises(InvalidArgument) as e:
            core.submit([1, 2, 3], 1, session_id="s", request_id=rid)
        assert len(str(e.value)) < 1000
    assert not core.scheduler.waiting and not core.scheduler.requests
    core.submit([1, 2, 3], 1, session_id="s", request_id="r" * 256)
    core.run_until_idle()


def test_import_waits_for_the_forward_pass_writing_an_aborted_turns_blocks() -> None:
    """Abort during a step's forward pass, then ImportContext: the import waits for the pass, so it never
    takes (and the pass never overwrites) blocks the pass is writing."""
    core, ex, _ = make_core(dev=8, host=0)
    twin, _, _ = make_core(dev=8, host=0)
    twin.submit([(5 * j) % 500 for j in range(31)], 1, session_id="B")
    twin.run_until_idle()
    blob = twin.export_context("B")  # 8 blocks: the whole pool
    in_forward = threading.Event()

    def slow_forward(batch: ScheduledBatch) -> None:
        if batch.seqs:
            in_forward.set()
            time.sleep(0.2)

    ex.before_execute = slow_forward
    r = core.submit(list(range(1, 30)), 2, session_id="A")
    errors: list[BaseException] = []

    def step() -> None:
        try:
            core.step()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=step)
    t.start()
    assert in_forward.wait(5)
    assert core.abort(r.request_id)
    assert core.import_context(blob) == (31, 8)
    t.join(5)
    assert not t.is_alive() and not errors
    ex.before_execute = None
    deep_check(core, ex)


def test_a_busy_node_does_not_starve_a_context_export() -> None:
    """The step loop takes ``executing`` again right after each step; a plain lock is not fair, so an export
    waiting for it could wait as long as the node stays busy (a 20 ms GIL-holding pass starved one > 10 s)."""

    class BusyExecutor(ModeledExecutor):
        def execute(self, batch: ScheduledBatch) -> StepOutput:
            out = super().execute(batch)
            t0 = time.perf_counter()
            while batch.seqs and time.perf_counter() - t0 < 0.02:  # holds the GIL, as a Python-heavy pass does
                pass
            return out

    ex = BusyExecutor(load_cost_model("cpu-tiny"), 512, 0, vocab_size=512, max_model_len=100_000)
    core = EngineCore(ex)
    core.start()
    try:
        first = core.submit([1, 2, 3, 4] * 8, 4, session_id="p")
        deadline = time.monotonic() + 10.0
        while first.state is not RequestState.FINISHED and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(4):  # long decodes: the node stays busy throughout
            core.submit([5] * 16, 5000, session_id=f"busy{i}")
        time.sleep(0.2)
        for _ in range(3):
            done = threading.Event()
            threading.Thread(target=lambda d=done: (core.export_context("p"), d.set()), daemon=True).start()
            assert done.wait(5.0), "the export waited behind the busy step loop"
    finally:
        core.stop()


def test_a_context_on_both_tiers_exports_block_by_block() -> None:
    """The torch executor's real layout: device and host parts join along the block axis (end to end, each
    block came back holding slices of the others)."""
    from engine_adapter._context_blocks import join_blocks as _join_blocks

    ex = make_torch_executor(num_device_blocks=8, num_host_blocks=4, device="cpu")
    nb = ex.layout.block_nbytes
    for tier, block, fill in (("device", 0, 1), ("device", 1, 2), ("host", 2, 3)):
        ex.write_blocks(tier, [block], bytes([fill]) * nb)  # type: ignore[arg-type]
    joined = _join_blocks(ex.kv_shape, [(ex.read_blocks("device", [0, 1]), 2), (ex.read_blocks("host", [2]), 1)])
    ex.write_blocks("device", [5, 6, 7], joined)
    assert [ex.read_blocks("device", [b]) for b in (5, 6, 7)] == [bytes([f]) * nb for f in (1, 2, 3)]


def _fail_copy_only_steps(batch: ScheduledBatch) -> None:
    if batch.copies and not batch.seqs:  # the flush of an export or import, not a step
        raise RuntimeError("device error (simulated)")


def test_an_export_whose_copy_flush_fails_leaves_no_context_on_unwritten_blocks() -> None:
    """Pending reloads (a Prefetch) are flushed by the export; if that fails, the context lets go of the
    blocks they were to fill, as after a failed step, and its next turn recomputes them."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8)
    core, ex, _ = make_core(dev=8, host=8, cfg=cfg)
    a1 = [(7 * i + 3) % VOCAB for i in range(16)]
    core.submit(a1, 1, session_id="A")
    core.run_until_idle()
    core.submit([(11 * i + 5) % VOCAB for i in range(28)], 1, session_id="B", program_id="pb")
    core.run_until_idle()
    a = core.kv.sessions["A"]
    assert a.host_block_ids, "A must have been offloaded for this test"
    core.kv.release_program("pb")
    core.kv.set_prefetch(a, 0.0)
    core.kv.tick()
    assert any(op.kind == "h2d" for op in core.kv.pending_copies)
    ex.before_execute = _fail_copy_only_steps
    with pytest.raises(RuntimeError, match="simulated"):
        core.export_context("A")
    ex.before_execute = None
    assert core.kv.pending_copies == []
    deep_check(core, ex)
    core.submit([*a1, 1, 2, 3, 4, 5], 1, session_id="A")
    core.run_until_idle()
    assert ex.errors == []


def test_an_import_whose_copy_flush_fails_leaks_nothing() -> None:
    """The offloads an import's allocation caused fail to run: the blocks taken for the import go back,
    no half-made session is left (RUNNING with no blocks could never run a turn), invariants hold."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8)
    src, _, _ = make_core(dev=8, host=8, cfg=cfg)
    src.submit([(5 * i + 1) % VOCAB for i in range(16)], 1, session_id="X")
    src.run_until_idle()
    blob = src.export_context("X")
    core, ex, _ = make_core(dev=8, host=8, cfg=cfg)
    core.submit([(7 * i + 3) % VOCAB for i in range(24)], 1, session_id="A")  # A holds 7 of 8 blocks
    core.run_until_idle()
    free_before = core.kv.device.num_free_blocks
    ex.before_execute = _fail_copy_only_steps
    with pytest.raises(RuntimeError, match="simulated"):
        core.import_context(blob)
    ex.before_execute = None
    assert blob.session_id not in core.kv.sessions
    assert core.kv.device.num_free_blocks >= free_before
    deep_check(core, ex)
    core.import_context(blob)  # and the node still takes it once the device works
    deep_check(core, ex)


def test_a_node_forgets_the_oldest_sessions_that_hold_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain traffic (a new session per request) on a node that drops contexts at once must not grow its
    table, or the cache state it streams, without bound: past the limit the oldest sessions holding
    nothing and carrying no hint go, and a session holding nothing is never listed."""
    monkeypatch.setattr(KVCacheManager, "max_empty_sessions", 10)
    core, _, _ = make_core(dev=24, host=0, retain_contexts=False)
    core.submit(list(range(1, 10)), 1, session_id="hinted", program_id="ph")
    core.run_until_idle()
    assert core.apply_hints([Priority(session_id="hinted", program_id="ph", program_age_s=1.0)])[0].ok
    for i in range(30):
        core.submit([i + 1] * 9, 1, session_id=f"s{i}")
        core.run_until_idle()
    assert len(core.kv.sessions) <= 11
    assert "hinted" in core.kv.sessions and "s29" in core.kv.sessions and "s0" not in core.kv.sessions
    # and the cache state a router watches lists none of them: they hold nothing here
    assert core.cache_state(include_sessions=True).sessions == []
    waiting = core.submit([7] * 9, 1, session_id="queued")
    assert [r.session_id for r in core.cache_state(include_sessions=True).sessions] == ["queued"]
    core.run_until_idle()
    assert waiting.output
    core.check_invariants()
    release_everything(core)
