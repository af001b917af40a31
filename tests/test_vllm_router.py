"""vLLM nodes for operators and for the router, against the real vLLM server of ``tests/test_vllm_backend.py``
(the same process, shared through :func:`shared_node`): the engine core's ``hintflow_*`` metrics read live
scheduler state; ``WatchCacheState`` streams a session's residency on change, and ``HintRuntime``'s router
prices a vLLM node from it next to an embedded node; vLLM's own KV events show a prompt's blocks, and
the residency derived from them equals the prefix hit vLLM then reports, before and after a flood
evicts it; the KV-event sidecar serves that view as a ``CacheState``.

Skipped, saying why, only where no Python has vLLM (the import below skips with test_vllm_backend's reason).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
from test_vllm_backend import BS, Node, _prompt, shared_node  # skips this module too where vLLM is missing

from hints import (
    HintBatch,
    Pin,
    Release,
    ack_from_proto,
    batch_to_proto,
    cache_state_from_proto,
    engine_pb2,
    engine_pb2_grpc,
)
from tests.vllm_support import scrape_metrics


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Node:
    return shared_node(tmp_path_factory, pytestconfig)


def _settle(node: Node, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
    """Wait until no KV event batch arrived for ``quiet_s``: the subscriber has what the server did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = node.kv.last_event_s
        if last is None or time.monotonic() - last >= quiet_s:
            return
        time.sleep(0.05)


def test_metrics_export_the_embedded_names_from_live_scheduler_state(node: Node) -> None:
    before = scrape_metrics(node.metrics_url)
    names = {name for name, _ in before}
    for name in (
        "hintflow_pinned_blocks",
        "hintflow_kv_free_blocks",
        "hintflow_kv_total_blocks",
        "hintflow_num_requests_waiting",
        "hintflow_num_requests_running",
        "hintflow_prefill_backlog_tokens",
        "hintflow_pin_expiries_total",
        "hintflow_pin_clamps_total",
        "hintflow_forced_unpins_total",
        "hintflow_hint_delivery_latency_seconds_count",
    ):
        assert name in names, sorted(names)
    assert before[("hintflow_kv_total_blocks", ())] == 31  # 32 blocks less vLLM's null block

    try:
        m = _prompt(60, 5 * BS + 9)
        node.complete(m, "m1", "pm1")
        batch = HintBatch(
            batch_id=900, hints=[Pin(session_id="m1", ttl_s=60), Pin(session_id="ghost", ttl_s=5)]
        )
        batch = batch.model_copy(update={"sent_unix_s": time.time()})
        ack = ack_from_proto(next(iter(node.stub.PushHints(iter([batch_to_proto(batch)]), timeout=30))))
        assert [r.code for r in ack.results] == ["OK", "NOT_FOUND"] and ack.results[0].pinned_blocks == 5
        state = node.state()
        after = scrape_metrics(node.metrics_url)
        assert after[("hintflow_pinned_blocks", ())] == state.pinned_blocks >= 5
        assert after[("hintflow_kv_free_blocks", ())] == state.free_blocks  # idle engine: nothing moves
        # m1 is new (the ghost's Pin makes no session); the gauge counts sessions without residency too, which
        # the state leaves out, so it is compared with itself
        assert (
            after[("hintflow_sessions", ())] == before[("hintflow_sessions", ())] + 1 >= len(state.sessions)
        )
        assert after[("hintflow_num_requests_running", ())] == 0
        pin_ok, pin_nf = (("code", "OK"), ("kind", "pin")), (("code", "NOT_FOUND"), ("kind", "pin"))
        assert after[("hintflow_hints_total", pin_ok)] == before.get(("hintflow_hints_total", pin_ok), 0) + 1
        assert after[("hintflow_hints_total", pin_nf)] == before.get(("hintflow_hints_total", pin_nf), 0) + 1
        latency = ("hintflow_hint_delivery_latency_seconds_count", ())
        assert after[latency] == before[latency] + 1

        node.hints(Release(program_id="pm1"))
        node.complete(m + [7], "m2", "pm2")
        assert node.hints(Pin(session_id="m2", ttl_s=0.3)).results[0].ok
        time.sleep(0.5)
        final = scrape_metrics(node.metrics_url)  # the scrape itself expires the lease on an idle engine
        assert final[("hintflow_pinned_blocks", ())] == 0
        expiries = ("hintflow_pin_expiries_total", ())
        assert final[expiries] == after[expiries] + 1
        released = ("hintflow_released_sessions_total", ())
        assert final[released] >= after[released] + 1
    finally:  # the node is shared: a failure here must not leave m1 pinned for the tests after it
        node.hints(Release(program_id="pm1"), Release(program_id="pm2"))


def test_watch_cache_state_streams_a_sessions_residency_on_change(node: Node) -> None:
    req = engine_pb2.WatchCacheStateRequest(interval_s=30.0, include_sessions=True)
    call = node.stub.WatchCacheState(req, timeout=60)
    states: list[Any] = []
    first = cache_state_from_proto(next(call))
    assert first.total_blocks == 31 and first.block_size == BS and first.version >= 1
    w = _prompt(61, 3 * BS + 5)
    t = threading.Thread(target=node.complete, args=(w, "w1", "pw1"))
    t0 = time.monotonic()
    t.start()
    try:
        for pb in call:  # far sooner than the 30 s interval: states come on change
            states.append(cache_state_from_proto(pb))
            res = {s.session_id: s for s in states[-1].sessions}
            if "w1" in res and res["w1"].state == "parked" and res["w1"].device_tokens == 3 * BS:
                break
        assert time.monotonic() - t0 < 10
        versions = [first.version] + [s.version for s in states]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        node.hints(Release(program_id="pw1"))
        t0 = time.monotonic()
        for pb in call:
            gone = cache_state_from_proto(pb)
            assert gone.version > versions[-1]
            if "w1" not in {s.session_id for s in gone.sessions}:
                break
        assert time.monotonic() - t0 < 10
    finally:
        call.cancel()
        t.join(30)


async def test_hint_runtime_routes_to_the_vllm_node_holding_the_session(node: Node) -> None:
    """A mixed fleet: the vLLM node (hint service address) and an embedded modeled node, one router."""
    from engine_adapter import build_engine, load_engine_config, start_node
    from orchestrator import RouteRequest
    from workflows import HintRuntime

    cfg = load_engine_config(
        None, node_id="emb", executor="modeled", num_device_blocks=64, pace_modeled=False
    )
    emb = await start_node(build_engine(cfg), "127.0.0.1", 0, metrics_port=-1)
    r = _prompt(62, 6 * BS + 3)
    await asyncio.to_thread(node.complete, r, "r1", "pr1")
    runtime = HintRuntime([node.hint_address, emb.address], watch_interval_s=0.2)
    try:
        await runtime.start()
        req = RouteRequest(session_id="r1", program_id="pr1", context_tokens=len(r) + 40)
        deadline = time.monotonic() + 15
        while True:
            try:
                decision = runtime.router.choose(req, time.monotonic())
                if decision.address == node.hint_address and len(decision.expected_s) == 2:
                    break
            except Exception:  # no state yet from either node
                pass
            assert time.monotonic() < deadline, "the router never saw the vLLM node's session"
            await asyncio.sleep(0.05)
        assert decision.reason == "warm" and decision.warm_tokens == 6 * BS
        assert decision.expected_s[node.hint_address] < decision.expected_s[emb.address]
        # a session neither node holds: priced cold on both
        cold = runtime.router.choose(RouteRequest("nobody", "p", len(r)), time.monotonic())
        assert cold.warm_tokens == 0 and cold.reason == "cold"
    finally:
        await runtime.stop()
        await emb.stop(grace=0.5)
        await asyncio.to_thread(node.hints, Release(program_id="pr1"))


def test_kv_events_residency_matches_the_prefix_hit_and_the_sidecar_serves_it(node: Node) -> None:
    from engine_adapter.vllm_backend import serve_sidecar

    assert node.state().pinned_blocks == 0  # nothing pinned: the flood below can evict everything
    p = _prompt(63, 5 * BS + 10)
    node.complete(p, "kv1", "pkv1")
    assert node.kv.wait_for(lambda r: r.session_blocks("kv1") == (5, 0), 10), node.kv.read(
        lambda r: r.sessions
    )
    assert node.kv.read(lambda r: r.block_size) == BS
    assert node.kv.read(lambda r: r.prefix_tokens(p)) == 5 * BS
    assert node.cached(p + [7], "kv1", "pkv1") == 5 * BS  # what the events said is what vLLM hits

    car = serve_sidecar(
        node.kv, node.base + "/metrics", metrics_port=0, node_id="vllm-kv", own_subscriber=False
    )
    try:
        stub = engine_pb2_grpc.EngineNodeStub(channel := grpc.insecure_channel(f"127.0.0.1:{car.port}"))
        state = cache_state_from_proto(
            stub.GetCacheState(engine_pb2.WatchCacheStateRequest(include_sessions=True), timeout=30)
        )
        assert state.node_id == "vllm-kv" and state.total_blocks == 31 and state.block_size == BS
        assert state.model_name == node.model and state.num_running == 0
        assert {s.session_id: s.device_tokens for s in state.sessions}["kv1"] == 5 * BS
        ack = ack_from_proto(
            next(
                iter(
                    stub.PushHints(
                        iter([batch_to_proto(HintBatch(batch_id=1, hints=[Pin(session_id="kv1", ttl_s=1)]))])
                    )
                )
            )
        )
        assert ack.results[0].code == "UNIMPLEMENTED"
        channel.close()

        node.flood(6, 8 * BS, seed=64)  # 48 blocks through a 31-block pool: vLLM evicts kv1's prefix
        _settle(node)
        derived = node.kv.read(lambda r: r.prefix_tokens(p))
        assert node.kv.read(lambda r: r.session_blocks("kv1"))[0] * BS == derived < 5 * BS
        assert node.cached(p + [7], "kv1", "pkv1") == derived
        evicted = scrape_metrics(f"http://127.0.0.1:{car.metrics_port}/metrics")[
            ("hintflow_evicted_blocks_total", ())
        ]
        assert evicted >= 5
    finally:
        car.stop()
        node.hints(Release(program_id="pkv1"))
    assert node.kv._thread.is_alive()  # the sidecar did not stop a subscriber it does not own
