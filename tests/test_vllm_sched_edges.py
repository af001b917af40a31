"""hintflow's scheduler at vLLM's edges: preemption, aborts, deferred block frees, cache resets, bad input.

In-process, in the vLLM venv's Python (``python -m tests.test_vllm_sched_edges MODEL``: one JSON report,
about 20 s on 2 cores; skipped, saying why, where no Python has vLLM): vLLM 0.32's real scheduler with
hintflow's rules, driven by the stand-in model runner of ``tests/test_vllm_async.py`` (no model run).

- preemption: vLLM frees a preempted request's blocks through ``_free_request_blocks``, the hook that
  also frees finished ones. A preemption is not a turn's end: the session stays "waiting" on the request,
  no pin is inferred or granted on the freed blocks, a turn flagged ``is_last_turn`` does not release its
  program before it has run, and the real finish is handled as one (snapshot, history, pin);
- a queued next turn aborted before admission keeps the session's pin and last context;
- vLLM's deferred block free (``defer_block_free``: async scheduling with a KV consumer connector) still
  leaves the finished turn's context to pin, and leaks no block;
- ``reset_prefix_cache`` succeeds with pins (they are dropped) and waits for the hint lock;
- a valid ``Priority`` hint with a huge age under strict program FCFS does not raise in ``add_request``;
- the FCFS bound (`HINTFLOW_FCFS_SLACK`) moves a turn ahead of older programs once FCFS would have
  started it;
- a session or program id the protocol cannot carry leaves the request to vLLM and never breaks
  ``GetCacheState``;
- the host tier's connector: one step's saves use distinct host slots, and a chain is evicted tail first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter.vllm_backend import REPO
from tests.test_vllm_async import BS, _Engine, _prompt, _scheduler

# ---- in the vLLM venv ----------------------------------------------------------------------------------


def _sched(model: str, *, infer: bool, engine_async: bool = False) -> tuple[Any, Any]:
    os.environ["HINTFLOW_INFER_HINTS"] = "1" if infer else "0"
    os.environ["HINTFLOW_INFER_RELOAD_S_PER_TOKEN"] = "0.01"  # re-prefill priced high: every turn end pins
    sched, request = _scheduler(model, engine_async=engine_async)
    sched.admit_guard = False
    return sched, request


def _req(
    request: Any, rid: str, prompt: list[int], session: str, program: str, max_tokens: int, **extra: Any
) -> Any:
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    hasher = request([1], None)._block_hasher
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"program_id": program, **extra})
    return Request(rid, prompt, p, None, block_hasher=hasher, session_id=session)


def _preemption(model: str, last_turn: bool) -> dict[str, Any]:
    """Two sessions of 12 prompt blocks and 400 output tokens each in the 31-block pool: vLLM preempts b."""
    sched, request = _sched(model, infer=True)
    engine = _Engine(sched, 1)
    ra = _req(request, "ra", _prompt(1, 12 * BS), "a", "pa", 400, tool="grep")
    rb = _req(request, "rb", _prompt(2, 12 * BS), "b", "pb", 400, tool="grep", is_last_turn=last_turn)
    sched.add_request(ra)
    sched.add_request(rb)
    at: dict[str, Any] | None = None
    resumed_running = None
    for _ in range(5000):
        if not (sched.has_requests() or engine.out):
            break
        engine.step()
        sb = sched.book.sessions.get("b")
        if at is None and rb.num_preemptions:
            at = {
                "state": sb.state if sb else None, "live": sorted(sb.live) if sb else None,
                "in_req_session": "rb" in sched._req_session, "inferred_pins": sched.infer.inferred_pins,
                "inferred_releases": sched.infer.inferred_releases, "pinned": sched.book.num_pinned_blocks,
                "program_known": "pb" in sched.book.programs,
            }  # fmt: skip
        if at is not None and resumed_running is None and rb.num_computed_tokens > 0 and sb is not None:
            resumed_running = sb.state
    sb = sched.book.sessions.get("b")
    sched.book.check_invariants()
    return {
        "preemptions": rb.num_preemptions, "at_preemption": at, "resumed_state": resumed_running,
        "finished": rb.is_finished(), "full_blocks": rb.num_tokens // BS,
        "b_known": sb is not None, "b_snapshot": len(sb.snapshot) if sb else None,
        "b_context": len(sb.context) if sb else None, "b_held": len(sb.held) if sb else None,
        "inferred_pins": sched.infer.inferred_pins, "inferred_releases": sched.infer.inferred_releases,
    }  # fmt: skip


def _abort_queued_turn(model: str) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Pin

    sched, request = _sched(model, infer=False)
    engine = _Engine(sched, 1)
    a = _prompt(1, 5 * BS + 10)
    engine.run(request(a, "a"))
    pinned = apply_hints(sched, [Pin(session_id="a", ttl_s=600)])[0].pinned_blocks
    nxt = request([*a, 7], "a")
    sched.add_request(nxt)  # the next turn arrives ...
    sched.finish_requests(
        nxt.request_id, RequestStatus.FINISHED_ABORTED
    )  # ... and is aborted, never admitted
    s = sched.book.sessions["a"]
    sched.book.check_invariants()
    return {
        "pinned_before": pinned, "pinned_after": sched.book.num_pinned_blocks, "snapshot_after": len(s.snapshot),
        "lease_kept": s.pin_deadline_s is not None, "state": s.state,
    }  # fmt: skip


def _deferred_free(model: str) -> dict[str, Any]:
    """vLLM defers a finished request's free while a step in flight may write its blocks (set here as vLLM
    sets it with async scheduling and a KV consumer connector, e.g. the host tier)."""
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Pin, Release

    sched, request = _sched(model, infer=False, engine_async=True)
    sched.defer_block_free = True
    engine = _Engine(sched, 2)
    hasher = request([1], None)._block_hasher
    # the turn ends on a stop token (as real turns end on EOS): the next step was already scheduled
    p = SamplingParams(max_tokens=50, stop_token_ids=[7], extra_args={"program_id": "pb"})
    rb = Request("rb", _prompt(2, 5 * BS + 10), p, None, block_hasher=hasher, session_id="b")
    deferred: list[bool] = []
    orig = type(sched)._request_blocks_can_be_freed

    def spy(self: Any, r: Any) -> bool:
        v = orig(self, r)
        deferred.append(not v)
        return bool(v)

    type(sched)._request_blocks_can_be_freed = spy
    try:
        engine.run(rb)
        s = sched.book.sessions["b"]
        r = apply_hints(sched, [Pin(session_id="b", ttl_s=600)])[0]
        out = {
            "deferred": any(deferred), "snapshot": len(s.snapshot), "pin": [r.pinned_blocks, r.requested_blocks],
            "deferred_frees_left": len(sched.deferred_frees),
        }  # fmt: skip
        # a pin sent while the turn runs is granted at a deferred free too
        sched2, _ = _sched(model, infer=False, engine_async=True)
        sched2.defer_block_free = True
        engine2 = _Engine(sched2, 2)
        rc = Request("rc", _prompt(3, 5 * BS + 10), p, None, block_hasher=hasher, session_id="c")
        sched2.add_request(rc)
        engine2.step()  # admitted (a pin sent before that would be consumed by the admission)
        out["pin_while_running"] = apply_hints(sched2, [Pin(session_id="c", ttl_s=600)])[0].message
        deferred.clear()
        engine2.run()
        out["deferred2"] = any(deferred)
    finally:
        type(sched)._request_blocks_can_be_freed = orig
    out["held_after_deferred_free"] = len(sched2.book.sessions["c"].held)
    sched2.book.check_invariants()
    apply_hints(sched, [Release(program_id="pb")])
    apply_hints(sched2, [Release(program_id="pb")])
    pool = sched.kv_cache_manager.block_pool
    out["free_after_release"] = [x.kv_cache_manager.block_pool.get_num_free_blocks() for x in (sched, sched2)]
    out["usable"] = pool.num_gpu_blocks - 1
    return out


def _reset_prefix_cache(model: str) -> dict[str, Any]:
    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Pin

    sched, request = _sched(model, infer=False)
    engine = _Engine(sched, 1)
    engine.run(request(_prompt(3, 5 * BS + 10), "c"))
    apply_hints(sched, [Pin(session_id="c", ttl_s=600)])
    out: dict[str, Any] = {"pinned": sched.book.num_pinned_blocks}
    # the reset waits for the hint lock (the hint service's thread may be changing the book)
    done = threading.Event()
    result: list[Any] = []
    with sched.hint_lock:
        t = threading.Thread(target=lambda: (result.append(sched.reset_prefix_cache()), done.set()))
        t.start()
        out["ran_under_a_held_lock"] = done.wait(0.5)
    t.join(10)
    out["returned"] = result[0] if result else None
    out["pinned_after"] = sched.book.num_pinned_blocks
    engine.run(request(_prompt(4, 5 * BS + 10), "d"))
    apply_hints(sched, [Pin(session_id="d", ttl_s=600)])
    sched.add_request(request(_prompt(5, 3 * BS), "e", max_tokens=50))
    for _ in range(3):
        engine.step()  # a running request: the reset preempts it (pause_generation(clear_cache=True))
    try:
        out["with_running"] = sched.reset_prefix_cache(reset_running_requests=True)
    except Exception as e:
        out["with_running"] = f"{type(e).__name__}: {e}"[:200]
    engine.run()
    sched.book.check_invariants()
    return out


def _huge_age(model: str) -> dict[str, Any]:
    from engine_adapter.vllm_backend._admission import CLASS_SCALE, PRIORITY_SCALE
    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Priority

    sched, request = _sched(model, infer=False)
    sched.aging_s = float("inf")  # HINTFLOW_PRIORITY_AGING_S=inf: strict program FCFS
    engine = _Engine(sched, 1)
    engine.run(request(_prompt(4, 200), "d"))
    # The protocol now refuses such an age (MAX_PROGRAM_AGE_S); the node must not trust that alone.
    huge = Priority.model_construct(session_id="d", program_age_s=1e306, priority_class=2)
    code = apply_hints(sched, [huge])[0].code
    out: dict[str, Any] = {"hint": code}
    r = request(_prompt(4, 300), "d")
    try:
        sched.add_request(r)
        out["add_request"] = "ok"
    except Exception as e:
        out["add_request"] = f"{type(e).__name__}: {e}"
    out["priority"] = [r.priority // CLASS_SCALE, r.priority % PRIORITY_SCALE]  # [class, program start ms]
    engine.run()
    # whatever the hint-derived state, add_request keeps the client's priority rather than raise
    sched.book.sessions["d"].priority_class = float("inf")  # type: ignore[assignment]
    r2 = request(_prompt(4, 300), "d")
    try:
        sched.add_request(r2)
        out["guarded"] = r2.priority
    except Exception as e:
        out["guarded"] = f"{type(e).__name__}: {e}"
    engine.run()
    return out


def _bad_ids(model: str) -> dict[str, Any]:
    from engine_adapter.vllm_backend._hint_service import _Servicer
    from hints import engine_pb2

    sched, request = _sched(model, infer=False)
    engine = _Engine(sched, 1)
    engine.run(request(_prompt(1, 300), "ok-session"))
    svc = _Servicer(sched)
    ask = engine_pb2.WatchCacheStateRequest(include_sessions=True)
    engine.run(request(_prompt(2, 300), "s" * 300))  # extra_body={"session_id": ...} or X-Session-ID
    engine.run(
        _req(request, "ctl", _prompt(3, 300), "fine", "prog\x07ram", 1)
    )  # a program id with a control char
    out: dict[str, Any] = {"sessions_in_book": sorted(sched.book.sessions)}
    try:
        out["get_cache_state"] = [s.session_id for s in svc.GetCacheState(ask, None).sessions]
    except Exception as e:
        out["get_cache_state"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    sched.book.session("x" * 300)  # however such a session got into the book, the node still reports
    try:
        out["with_bad_session"] = [s.session_id for s in svc.GetCacheState(ask, None).sessions]
    except Exception as e:
        out["with_bad_session"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    # hints meant for an earlier life of the node (it restarted since) are refused, none applied
    from hints import HintBatch, Pin, ack_from_proto, batch_to_proto

    pin = [Pin(session_id="ok-session", ttl_s=30)]
    state = svc.GetCacheState(ask, None)
    out["epochs"] = [state.node_epoch, sched.node_epoch]
    stale = ack_from_proto(svc._apply_batch(batch_to_proto(HintBatch(batch_id=1, hints=pin, node_epoch=7))))
    out["stale"] = [[r.code for r in stale.results], stale.node_epoch, bool(sched.book.sessions["ok-session"].held)]
    fresh = batch_to_proto(HintBatch(batch_id=2, hints=pin, node_epoch=sched.node_epoch))
    out["fresh"] = [r.code for r in ack_from_proto(svc._apply_batch(fresh)).results]
    return out


def _host_tier(model: str) -> dict[str, Any]:
    """The connector's scheduler side alone, write-through: a 6-block turn into a 4-slot host tier, then another."""
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # type: ignore[import-not-found]
    from vllm.engine.arg_utils import EngineArgs  # type: ignore[import-not-found]

    from engine_adapter.vllm_backend import host_tier_config
    from engine_adapter.vllm_backend._host_connector import HintflowHostTier

    args = EngineArgs(
        model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
        kv_transfer_config=KVTransferConfig(**host_tier_config(4 * BS, "write-through")),
    )  # fmt: skip
    tier = HintflowHostTier(args.create_engine_config(), KVConnectorRole.SCHEDULER, None)
    step = SimpleNamespace(num_scheduled_tokens={})

    def turn(rid: str, hashes: list[str], block_ids: list[int]) -> list[tuple[int, int]]:
        req = SimpleNamespace(request_id=rid, block_hashes=hashes, num_computed_tokens=len(hashes) * BS)
        tier.request_finished(req, block_ids)
        return list(tier.build_connector_meta(step).saves)

    first = turn("r1", [f"a{i}" for i in range(6)], list(range(10, 16)))
    second = turn("r2", ["b0", "b1"], [20, 21])
    tier.index.check()
    return {
        "first_saves": first, "second_saves": second,
        "held": [h for h in ("a0", "a1", "a2", "a3", "b0", "b1") if h in tier.index],
    }  # fmt: skip


def _grace(model: str) -> dict[str, Any]:
    """A session the orchestrator pinned once is held at its next turn's end until a decision arrives (at
    most HINTFLOW_PIN_GRACE_S); one never pinned is freed at once; a decision of ttl 0 lets go."""
    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Pin

    sched, request = _sched(model, infer=False)
    engine = _Engine(sched, 1)
    a, b = _prompt(1, 4 * BS + 10), _prompt(2, 4 * BS + 10)
    engine.run(request(a, "a"))
    engine.run(request(b, "b"))
    apply_hints(sched, [Pin(session_id="a", ttl_s=0.0)])  # an orchestrator decision: a is "pinned" by it
    engine.run(request([*a, 7, 7], "a"))  # a's next turn ends: no pin yet, the grace holds its context
    engine.run(request([*b, 7, 7], "b"))
    sa, sb = sched.book.sessions["a"], sched.book.sessions["b"]
    out: dict[str, Any] = {"held_a": len(sa.held), "held_b": len(sb.held), "grace_holds": sched.grace_holds,
                           "lease_s": (sa.pin_deadline_s or 0.0) - sched.book.clock()}
    apply_hints(sched, [Pin(session_id="a", ttl_s=0.0)])  # the decision arrives: no pin
    out["held_a_after"] = len(sa.held)
    sched.book.check_invariants()
    return out


def _fcfs_bound(model: str) -> dict[str, Any]:
    """Strict program FCFS, a budget of one 600-token prefill a step: an old program's first turn (600
    tokens), a new program's, then two more of the old program's, queued at once. The order in which
    vLLM first schedules them, without and with the FCFS bound (slack 0), and how many fell due."""
    from engine_adapter._fcfs_bound import FcfsBound

    out: dict[str, Any] = {}
    for name, slack in (("off", float("inf")), ("on", 0.0)):
        sched, request = _sched(model, infer=False)
        sched.aging_s = float("inf")
        sched.fcfs_bound = FcfsBound(slack)
        sched.max_num_scheduled_tokens = 604  # one prefill (and the decodes) a step
        engine = _Engine(sched, 1)
        engine.run(_req(request, "warm-up", _prompt(30, 64), "o0", "old", 2))  # the old program started first
        # (the old program's turns on its first session: without hints a program's start is its session's)
        queued = [("o1", "o0", "old"), ("n1", "n", "new"), ("o2", "o0", "old"), ("o3", "o0", "old")]
        for i, (rid, sid, prog) in enumerate(queued):
            sched.add_request(_req(request, rid, _prompt(40 + i, 600), sid, prog, 2))
        engine.run()
        out[name] = {"order": [r for r in engine.hits if r != "warm-up"], "due": sched.fcfs_bound.num_due,
                     "left": len(sched.fcfs_bound)}  # fmt: skip
    os.environ["HINTFLOW_FCFS_SLACK"] = "-1"
    try:
        _sched(model, infer=False)
        out["negative"] = "started"
    except ValueError as e:
        out["negative"] = str(e)
    finally:
        del os.environ["HINTFLOW_FCFS_SLACK"]
    return out


def _report(model: str) -> dict[str, Any]:
    return {
        "grace": _grace(model),
        "preempt": _preemption(model, last_turn=False), "preempt_last": _preemption(model, last_turn=True),
        "abort": _abort_queued_turn(model), "deferred": _deferred_free(model), "reset": _reset_prefix_cache(model),
        "huge_age": _huge_age(model), "bad_ids": _bad_ids(model), "host_tier": _host_tier(model),
        "fcfs_bound": _fcfs_bound(model),
    }  # fmt: skip


# ---- the tests (the report comes from the vLLM venv) ------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.vllm_support import tiny_model, vllm_python_or_skip

    python = vllm_python_or_skip()
    model = tiny_model(tmp_path_factory, python)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    r = subprocess.run(
        [python, "-m", "tests.test_vllm_sched_edges", str(model)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_an_orchestrated_session_is_held_at_its_turn_end_until_the_decision(report: dict[str, Any]) -> None:
    r = report["grace"]
    assert r["held_a"] == 4 and r["grace_holds"] == 1 and 0.0 < r["lease_s"] <= 0.5  # HINTFLOW_PIN_GRACE_S
    assert r["held_b"] == 0  # never pinned by an orchestrator: freed as vLLM frees it
    assert r["held_a_after"] == 0


@pytest.mark.parametrize("case", ["preempt", "preempt_last"])
def test_a_preemption_is_not_the_end_of_a_turn(report: dict[str, Any], case: str) -> None:
    """Before: the preempted request left its session (parked, live=[]), the inference pinned the freed
    blocks, and a last turn released its program while it still had to run."""
    r = report[case]
    assert r["preemptions"] == 1 and r["finished"]
    at = r["at_preemption"]
    assert at["state"] == "waiting" and at["live"] == ["rb"] and at["in_req_session"]
    assert at["inferred_releases"] == 0 and at["program_known"]
    assert at["inferred_pins"] == 0 and at["pinned"] == 0  # nothing pinned on the preempted blocks
    assert r["resumed_state"] == "running"  # resumed: admitted again
    if case == "preempt":  # the real finish is the turn's end: its full blocks, its history, its pin
        assert r["b_snapshot"] == r["full_blocks"] and r["b_held"] > 0
        assert r["b_context"] >= r["full_blocks"] * BS and r["inferred_pins"] == 2
    else:  # the last turn ran to its end, then released its program
        assert not r["b_known"] and r["inferred_releases"] == 1 and r["inferred_pins"] == 1


def test_an_aborted_queued_turn_keeps_the_sessions_pin(report: dict[str, Any]) -> None:
    r = report["abort"]
    assert r["pinned_before"] == 5
    assert r["pinned_after"] == 5 and r["snapshot_after"] == 5 and r["lease_kept"] and r["state"] == "parked"


def test_a_deferred_block_free_leaves_the_context_to_pin_and_leaks_nothing(report: dict[str, Any]) -> None:
    r = report["deferred"]
    assert r["deferred"] and r["deferred2"]  # vLLM did defer the free
    assert r["snapshot"] == 5 and r["pin"] == [5, 5]  # before: an empty snapshot, a pin of 0 blocks
    assert r["pin_while_running"] == "pin applies when the running turn ends"
    assert r["held_after_deferred_free"] == 5
    assert r["deferred_frees_left"] == 0 and r["free_after_release"] == [r["usable"]] * 2


def test_a_prefix_cache_reset_drops_pins_under_the_hint_lock(report: dict[str, Any]) -> None:
    r = report["reset"]
    assert r["pinned"] == 5
    assert not r["ran_under_a_held_lock"]  # it waited for the lock
    assert r["returned"] is True and r["pinned_after"] == 0  # before: False, the pin kept
    assert r["with_running"] is True  # before: RuntimeError (pause_generation(clear_cache=True))


def test_a_huge_program_age_under_strict_fcfs_does_not_raise_in_add_request(report: dict[str, Any]) -> None:
    r = report["huge_age"]
    assert r["hint"] == "OK"
    assert r["add_request"] == "ok"  # before: OverflowError, fatal to vLLM
    assert r["priority"] == [2, 0]  # the hinted class; the oldest start there is (clamped, not an error)
    assert r["guarded"] == 0  # the client's priority


def test_ids_the_protocol_cannot_carry_never_break_the_cache_state(report: dict[str, Any]) -> None:
    r = report["bad_ids"]
    assert r["sessions_in_book"] == ["ok-session"]  # the others are vLLM's own requests
    assert r["get_cache_state"] == ["ok-session"]  # before: a ValidationError for the whole node
    assert r["with_bad_session"] == ["ok-session"]


def test_a_hint_batch_for_an_earlier_life_of_the_node_is_refused(report: dict[str, Any]) -> None:
    r = report["bad_ids"]
    epoch = r["epochs"][1]
    assert r["epochs"][0] == epoch != 0  # reported in CacheState
    assert r["stale"] == [["FAILED_PRECONDITION"], epoch, False]  # refused, the pin not applied
    assert r["fresh"] == ["OK"]


def test_one_steps_host_saves_use_distinct_slots_and_a_chain_loses_its_tail_first(
    report: dict[str, Any],
) -> None:
    r = report["host_tier"]
    first = [tuple(x) for x in r["first_saves"]]
    assert len({slot for _, slot in first}) == len(first) == 4  # before: 6 saves, slots 0 and 1 twice
    assert [dev for dev, _ in first] == [10, 11, 12, 13]  # the head of the turn first
    assert r["held"] == ["a0", "a1", "b0", "b1"]  # the next turn took the first one's tail (a3, a2)


if __name__ == "__main__":
    print(json.dumps(_report(sys.argv[1])))


def test_the_fcfs_bound_starts_a_new_programs_turn_once_fcfs_would_have(report: dict[str, Any]) -> None:
    # Strict program FCFS serves the old program's three turns before the new program's first turn; with
    # the bound, the new turn goes first once the node has computed the 600 tokens queued ahead of it (by
    # then the one-prefill budget had started a chunk of o2). Nothing is left tracked once all have run.
    got = report["fcfs_bound"]
    assert got["off"] == {"order": ["o1", "o2", "o3", "n1"], "due": 0, "left": 0}, got
    assert got["on"]["order"].index("n1") < got["on"]["order"].index("o3"), got
    assert got["on"]["due"] >= 1 and got["on"]["left"] == 0, got
    assert got["negative"].startswith("HINTFLOW_FCFS_SLACK:") and "-1" in got["negative"], got  # refused at start
