"""No accounting leak: after any mix of requests, hints, expiries and errors, free + used == pool."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_adapter import EngineCore, EngineError, SchedulerConfig, VirtualClock, make_torch_executor
from hints import EvictionOrder, Expect, HintDecodeError, NextUse, Pin, Prefetch, Priority, Release

SESSIONS = [f"s{i}" for i in range(5)]
PROGRAMS = {s: f"p{int(s[1:]) % 3}" for s in SESSIONS}

_submit = st.tuples(st.just("submit"), st.sampled_from(SESSIONS), st.integers(1, 120), st.integers(1, 12))
op = st.one_of(
    _submit,
    _submit,
    _submit,
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("submit_bad"), st.sampled_from(SESSIONS), st.sampled_from(["vocab", "long", "empty"])),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("pin"), st.sampled_from([*SESSIONS, "ghost"]), st.floats(0, 5)),
    st.tuples(st.just("order"), st.sampled_from(SESSIONS), st.floats(0, 50)),
    st.tuples(st.just("prefetch"), st.sampled_from(SESSIONS), st.floats(0, 2)),
    st.tuples(st.just("priority"), st.sampled_from(SESSIONS), st.floats(0, 100)),
    st.tuples(st.just("expect"), st.sampled_from(SESSIONS), st.integers(0, 50)),
    st.tuples(st.just("release"), st.sampled_from(sorted(set(PROGRAMS.values())))),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("advance"), st.floats(0, 3)),
    st.tuples(st.just("bad_hint"),),
    st.tuples(st.just("move"), st.sampled_from(SESSIONS)),
)


# host tier: none; filled on eviction (ours); write-through (vLLM's connectors), with contexts retained or
# not (vLLM's own scheduler)
HOST_MODES = {"none": (0, False, True), "on-evict": (12, False, True), "write-through": (12, True, True),
              "write-through, vLLM": (12, True, False)}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=10, max_size=60), mode=st.sampled_from(sorted(HOST_MODES)), seed=st.integers(0, 3))
def test_any_mix_of_operations_keeps_every_block_accounted(ops: list[tuple], mode: str, seed: int) -> None:  # type: ignore[type-arg]
    host, write_through, retain = HOST_MODES[mode]
    event(f"host tier: {mode}")
    ex = make_torch_executor(num_device_blocks=32, block_size=4, num_host_blocks=host, num_layers=1, hidden_size=32,
                             num_heads=2, num_kv_heads=1, intermediate_size=32, max_model_len=512, seed=seed)
    clock = VirtualClock()
    core = EngineCore(ex, clock=clock, scheduler_config=SchedulerConfig(max_num_batched_tokens=64,
                      cold_prefill_budget_tokens=16, warm_threshold_tokens=8), pin_budget_fraction=0.3,
                      host_write_through=write_through, retain_contexts=retain)
    history: dict[str, list[int]] = {}
    submitted: list[str] = []
    for o in ops:
        kind = o[0]
        try:
            if kind == "submit":
                _, sid, n_new, n_out = o
                prompt = history.get(sid, []) + [(len(history.get(sid, [])) * 7 + i) % 500 for i in range(n_new)]
                prompt = prompt[-100:]
                busy = core.kv.sessions.get(sid)
                for _ in range(200):  # a session runs one turn at a time: let its last turn finish
                    if busy is None or busy.state.value == "parked":
                        break
                    core.step()
                req = core.submit(prompt, n_out, session_id=sid, program_id=PROGRAMS[sid])
                history[sid] = prompt
                submitted.append(req.request_id)
            elif kind == "submit_bad":
                _, sid, why = o
                prompt = {"vocab": [1, 10**6], "long": [1] * 600, "empty": []}[why]
                core.submit(prompt, 1, session_id=sid)
                raise AssertionError("a bad request was accepted")
            elif kind == "step":
                for _ in range(o[1]):
                    core.step()
            elif kind == "pin":
                core.apply_hints([Pin(session_id=o[1], ttl_s=o[2])])
            elif kind == "order":
                core.apply_hints([EvictionOrder(entries=[NextUse(session_id=o[1], next_use_s=o[2])])])
            elif kind == "prefetch":
                core.apply_hints([Prefetch(session_id=o[1], at_s=o[2])])
            elif kind == "priority":
                core.apply_hints([Priority(session_id=o[1], program_age_s=o[2])])
            elif kind == "expect":
                core.apply_hints([Expect(session_id=o[1], output_tokens=o[2])])
            elif kind == "release":
                core.apply_hints([Release(program_id=o[1])])
            elif kind == "abort" and submitted:
                core.abort(submitted[o[1] % len(submitted)])
            elif kind == "advance":
                clock.advance(o[1])
            elif kind == "bad_hint":
                res = core.apply_hints([HintDecodeError("ttl_s: not finite", kind="pin", index=0)])
                assert res[0].code == "INVALID_ARGUMENT"
            elif kind == "move":
                blob = core.export_context(o[1], release_after=True)
                core.import_context(blob)
        except EngineError as e:
            event(f"{kind}: {type(e).__name__}")
        core.check_invariants()
        kv = core.kv
        assert kv.device.num_free_blocks + kv.device.num_used_blocks == kv.device.num_blocks
    core.run_until_idle()
    core.check_invariants()
    event(f"submitted {min(len(submitted) // 5 * 5, 20)}+")
    event(f"evicted blocks > 0: {core.kv.stats.evicted_blocks > 0}")
    event(f"preemptions > 0: {core.scheduler.num_preemptions > 0}")
    event(f"offloaded > 0: {core.kv.stats.offloaded_blocks > 0}")
    assert not core.scheduler.running and not core.scheduler.waiting
    # With every program released, every block is free again: nothing was lost on any path.
    core.apply_hints([Release(program_id=p) for p in sorted(set(PROGRAMS.values())) if p in core.kv.programs])
    for s in list(core.kv.sessions.values()):
        core.kv.free_session(s)
    core.check_invariants()
    assert core.kv.device.num_free_blocks == core.kv.device.num_blocks
    assert core.kv.host.num_free_blocks == core.kv.host.num_blocks
    assert core.kv.num_pinned_blocks == 0
