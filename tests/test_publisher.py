"""HintPublisher against real torch-executor nodes on loopback: delivery, outages, restarts, aging, bounds.

Each test passes its own CollectorRegistry, so metrics start at zero and never collide. Nodes that come
and go share a port chosen up front (bind port 0, close, reuse), as a restarted engine node would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

from engine_adapter import EngineCore, RunningNode, build_engine, load_engine_config, start_node
from hints import (
    EngineClient,
    EvictionOrder,
    Expect,
    HintAck,
    HintModel,
    HintResult,
    NextUse,
    Pin,
    Prefetch,
    Priority,
    Release,
)
from tests.polling import free_port, until
from workflows._publisher import HintPublisher, _aged

MODEL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "max_model_len": 256,
    "block_size": 16,
    "seed": 0,
}


def _core(node_id: str) -> EngineCore:
    cfg = load_engine_config(
        None, node_id=node_id, num_device_blocks=64, num_host_blocks=8, pin_budget_fraction=0.25, model=MODEL
    )
    return build_engine(cfg)


async def _node(node_id: str, port: int = 0) -> RunningNode:
    core = await asyncio.to_thread(_core, node_id)
    return await start_node(core, "127.0.0.1", port, metrics_port=None)



def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % MODEL["vocab_size"] for i in range(n)]


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0



class _Recorder:
    """An ``on_ack`` that keeps every delivered (aged) hint with its result code, in delivery order."""

    def __init__(self) -> None:
        self.delivered: list[tuple[HintModel, str]] = []

    def __call__(self, hints: list[HintModel], ack: HintAck) -> None:
        self.delivered += [(h, r.code) for h, r in zip(hints, ack.results, strict=True)]

    def sessions(self) -> list[str]:
        return [getattr(h, "session_id", "") for h, _ in self.delivered]


async def test_pin_is_delivered_and_counted() -> None:
    node = await _node("pub-a")
    reg, rec = CollectorRegistry(), _Recorder()
    pub = HintPublisher(node.address, registry=reg, on_ack=rec)
    try:
        async with EngineClient(node.address) as client:
            await client.generate(_prompt(1, 40), 2, session_id="s-pin", program_id="p-pin")
            pub.start()
            pub.publish([Pin(session_id="s-pin", ttl_s=60, reason="tool call")])
            assert await pub.flush(5.0)
            state = await client.get_cache_state(include_sessions=True)
        assert [s.pinned for s in state.sessions if s.session_id == "s-pin"] == [True]
        assert state.pinned_blocks > 0
        assert (pub.num_sent, pub.num_acked_ok, pub.num_failures, pub.num_dropped) == (1, 1, 0, 0)
        assert pub.num_pending == 0
        assert pub.connected
        assert rec.delivered[0][1] == "OK" and 59 < rec.delivered[0][0].ttl_s <= 60  # type: ignore[union-attr]
        node_label = {"node": node.address}
        assert _value(reg, "hintflow_hint_delivery_seconds_count", **node_label) == 1
        assert 0 < _value(reg, "hintflow_hint_delivery_seconds_sum", **node_label) < 5
        assert _value(reg, "hintflow_hints_sent_total", code="OK", **node_label) == 1
        assert _value(reg, "hintflow_publisher_connected", **node_label) == 1
        assert _value(reg, "hintflow_hint_push_failures_total", **node_label) == 0
    finally:
        await pub.close()
        await node.stop(grace=0.1)


async def test_node_down_at_start_then_up_ages_and_expires(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workflows._publisher")
    port = free_port()
    address = f"127.0.0.1:{port}"
    reg, rec = CollectorRegistry(), _Recorder()
    pub = HintPublisher(address, registry=reg, on_ack=rec, backoff_initial_s=0.02, backoff_max_s=0.2)
    node: RunningNode | None = None
    try:
        pub.start()
        pub.publish(
            [
                Pin(session_id="lapses", ttl_s=0.5),
                Pin(session_id="unpin-me", ttl_s=0),  # an unpin is delivered however late
                Priority(session_id="old", program_age_s=1.0),
                Prefetch(session_id="soon", at_s=0.3),
                EvictionOrder(entries=[]),  # applies on any node: OK
            ]
        )
        t0 = time.monotonic()  # after publishing: the hints are at least 0.8 s old when the node is up
        core = await asyncio.to_thread(_core, "pub-b")
        await asyncio.sleep(max(0.0, 0.8 - (time.monotonic() - t0)))
        assert not pub.connected and pub.num_failures >= 2 and pub.num_sent == 0
        assert _value(reg, "hintflow_hint_push_failures_total", node=address) == pub.num_failures
        assert _value(reg, "hintflow_publisher_connected", node=address) == 0

        node = await start_node(core, "127.0.0.1", port, metrics_port=None)
        assert await pub.flush(5.0)
        assert pub.connected and pub.num_pending == 0
        assert pub.num_dropped == 1
        assert _value(reg, "hintflow_hints_dropped_total", node=address, reason="expired") == 1
        assert pub.num_sent == 4 and pub.num_acked_ok == 1
        kinds = [type(h).__name__ for h, _ in rec.delivered]
        assert kinds == ["Pin", "Priority", "Prefetch", "EvictionOrder"]
        unpin, priority, prefetch, _ = (h for h, _ in rec.delivered)
        assert isinstance(unpin, Pin) and unpin.ttl_s == 0
        assert isinstance(priority, Priority) and priority.program_age_s >= 1.8
        assert isinstance(prefetch, Prefetch) and prefetch.at_s == 0
        # A fresh node knows none of these sessions; the empty eviction order applies anywhere.
        assert [code for _, code in rec.delivered] == ["NOT_FOUND", "NOT_FOUND", "NOT_FOUND", "OK"]
        assert _value(reg, "hintflow_hints_sent_total", node=address, code="OK") == 1
        assert _value(reg, "hintflow_hints_sent_total", node=address, code="NOT_FOUND") == 3
        assert _value(reg, "hintflow_hint_delivery_seconds_count", node=address) == 4
        assert _value(reg, "hintflow_hint_delivery_seconds_sum", node=address) >= 4 * 0.8
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        infos = [r for r in caplog.records if r.levelno == logging.INFO]
        assert pub.num_failures > 1  # retried more than once, yet ...
        assert len(warnings) == 1 and address in warnings[0].message and "UNAVAILABLE" in warnings[0].message
        assert len(infos) == 1 and "back after" in infos[0].message  # ... one line per state change
    finally:
        await pub.close()
        if node is not None:
            await node.stop(grace=0.1)


async def _outage(pub: HintPublisher, reg: CollectorRegistry, address: str) -> None:
    """Hints published while the node is down: five, the first two one batch (``max_batch=2``)."""
    pub.publish([Pin(session_id="during-1", ttl_s=0), Pin(session_id="during-2", ttl_s=0)])
    await until(lambda: not pub.connected, 5.0)
    assert _value(reg, "hintflow_publisher_connected", node=address) == 0
    pub.publish([Expect(session_id="during-3", output_tokens=5), Pin(session_id="during-4", ttl_s=0)])
    pub.publish([Release(program_id="during-5")])
    await asyncio.sleep(0.3)
    assert not pub.connected and pub.num_pending == 5 and not await pub.flush(0.05)


@pytest.mark.parametrize("life", ["same", "new"])
async def test_node_back_gets_outage_hints_in_order_only_in_the_same_life(life: str) -> None:
    """A node whose server comes back (the same process: the same epoch) gets what was queued, in order,
    each once. A node that restarted (a new process: a new epoch, empty) applies none of it: hints meant
    for its earlier life are refused or dropped, and those published once its new life is known apply."""
    node = await _node("pub-c1")
    address, port = node.address, node.port
    reg, rec = CollectorRegistry(), _Recorder()
    pub = HintPublisher(
        address, registry=reg, on_ack=rec, backoff_initial_s=0.02, backoff_max_s=0.2, max_batch=2
    )
    restarted: RunningNode | None = None
    try:
        pub.start()
        pub.publish([Pin(session_id="before", ttl_s=0)])
        assert await pub.flush(5.0) and pub.connected
        assert pub.node_epoch == node.core.node_epoch != 0
        core = node.core if life == "same" else await asyncio.to_thread(_core, "pub-c2")
        await node.stop(grace=0)
        await _outage(pub, reg, address)

        restarted = await start_node(core, "127.0.0.1", port, metrics_port=None)
        assert await pub.flush(5.0)
        assert pub.connected and _value(reg, "hintflow_publisher_connected", node=address) == 1
        if life == "same":
            expected = ["before", "during-1", "during-2", "during-3", "during-4", ""]
            assert rec.sessions() == expected  # in order, each exactly once
            assert isinstance(rec.delivered[-1][0], Release) and rec.delivered[-1][0].program_id == "during-5"
            assert pub.num_sent == 6 and pub.num_dropped == 0 and pub.num_failures >= 1
            return
        # the batch in flight reached the new node, which refused it; the rest was dropped on its ack
        assert rec.sessions() == ["before", "during-1", "during-2"]
        # (a pin of a session the node does not hold is NOT_FOUND: applied, to nothing)
        assert [code for _, code in rec.delivered] == ["NOT_FOUND", "FAILED_PRECONDITION", "FAILED_PRECONDITION"]
        assert pub.num_dropped == 3 == _value(reg, "hintflow_hints_dropped_total", node=address, reason="restarted")
        assert pub.node_epoch == core.node_epoch != node.core.node_epoch
        pub.publish([Pin(session_id="after", ttl_s=0)])  # for the new life: applied
        assert await pub.flush(5.0)
        assert rec.delivered[-1][0].session_id == "after" and rec.delivered[-1][1] == "NOT_FOUND"  # type: ignore[union-attr]
    finally:
        await pub.close()
        await node.stop(grace=0)
        if restarted is not None:
            await restarted.stop(grace=0.1)


class _FakeClient:
    """Stands in for EngineClient: fails while ``down``, else acks every hint OK and records it."""

    down: ClassVar[bool] = True
    received: ClassVar[list[HintModel]] = []

    def __init__(self, address: str) -> None:
        self.address = address

    async def push_hints(
        self, hints: Sequence[HintModel], batch_id: int | None = None, node_epoch: int = 0
    ) -> HintAck:
        if _FakeClient.down:
            raise ConnectionError("node down")
        _FakeClient.received += hints
        return HintAck(batch_id=batch_id or 0, results=[HintResult(index=i) for i in range(len(hints))])

    async def close(self) -> None:
        pass


async def test_queue_bound_drops_oldest() -> None:
    _FakeClient.down, _FakeClient.received = True, []
    reg = CollectorRegistry()
    pub = HintPublisher(
        "fake:1", registry=reg, max_pending=5, backoff_initial_s=0.01, backoff_max_s=0.02,
        client_factory=_FakeClient,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        pub.start()
        pub.publish([Expect(session_id=f"s{i}", output_tokens=i) for i in range(10)])
        assert pub.num_pending == 5 and pub.num_dropped == 5
        assert _value(reg, "hintflow_hints_dropped_total", node="fake:1", reason="queue-full") == 5
        await until(lambda: pub.num_failures >= 3, 5.0)
        assert pub.num_pending == 5 and pub.num_dropped == 5  # retries neither lose nor duplicate
        _FakeClient.down = False
        assert await pub.flush(2.0)
        assert [h.session_id for h in _FakeClient.received] == [f"s{i}" for i in range(5, 10)]  # type: ignore[union-attr]
        assert pub.num_sent == pub.num_acked_ok == 5
    finally:
        await pub.close()


class _CancelledOnce(_FakeClient):
    """Raises CancelledError from its first push, as gRPC does from a call cancelled under it (a fake:
    a real channel does so only in races a test cannot time)."""

    pushes: ClassVar[int] = 0

    async def push_hints(
        self, hints: Sequence[HintModel], batch_id: int | None = None, node_epoch: int = 0
    ) -> HintAck:
        _CancelledOnce.pushes += 1
        if _CancelledOnce.pushes == 1:
            raise asyncio.CancelledError
        return await super().push_hints(hints, batch_id, node_epoch)


async def test_a_push_cancelled_under_the_sender_is_a_failed_push_not_its_end() -> None:
    _FakeClient.down, _FakeClient.received, _CancelledOnce.pushes = False, [], 0
    pub = HintPublisher(
        "fake:2", registry=CollectorRegistry(), backoff_initial_s=0.01, backoff_max_s=0.02,
        client_factory=_CancelledOnce,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        pub.start()
        pub.publish([Pin(session_id="s", ttl_s=30.0)])
        assert await pub.flush(2.0)
        assert pub.num_failures == 1 and pub.num_sent == 1 and pub.num_sender_restarts == 0
        assert [h.session_id for h in _FakeClient.received] == ["s"]  # type: ignore[union-attr]
        task = pub._task
        assert task is not None and not task.done()
    finally:
        await pub.close()


async def test_a_sender_that_dies_is_restarted_with_its_batch(caplog: pytest.LogCaptureFixture) -> None:
    _FakeClient.down, _FakeClient.received = False, []
    pub = HintPublisher(
        "fake:3", registry=CollectorRegistry(), backoff_initial_s=0.01, backoff_max_s=0.05,
        client_factory=_FakeClient,  # type: ignore[arg-type]
    )  # fmt: skip
    take = pub._take_batch

    def broken_once() -> Any:  # a bug in the sender's own bookkeeping, once, with the batch in flight
        take()
        pub._take_batch = take  # type: ignore[method-assign]
        raise RuntimeError("bookkeeping bug")

    pub._take_batch = broken_once  # type: ignore[method-assign]
    try:
        pub.start()
        pub.publish([Expect(session_id=f"s{i}", output_tokens=i) for i in range(3)])
        assert await pub.flush(2.0)
        assert pub.num_sender_restarts == 1 and pub.num_sent == 3
        assert [h.session_id for h in _FakeClient.received] == ["s0", "s1", "s2"]  # type: ignore[union-attr]
        assert "RuntimeError: bookkeeping bug" in caplog.text
    finally:
        await pub.close()
    assert pub._task is None


async def test_close_is_idempotent_and_stops_the_task() -> None:
    never_started = HintPublisher(f"127.0.0.1:{free_port()}", registry=CollectorRegistry())
    await never_started.close()
    await never_started.close()

    pub = HintPublisher(f"127.0.0.1:{free_port()}", registry=CollectorRegistry(), backoff_initial_s=0.01)
    pub.start()
    pub.publish([Pin(session_id="s", ttl_s=0)])
    await until(lambda: pub.num_failures >= 1, 5.0)
    task = pub._task
    assert task is not None and not task.done()
    await pub.close()
    await pub.close()
    assert task.done() and pub._task is None and not pub.connected
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("hint-publisher")]
    with pytest.raises(RuntimeError):
        pub.publish([Pin(session_id="s", ttl_s=0)])
    with pytest.raises(RuntimeError):
        pub.start()


def test_aging_rules() -> None:
    order = EvictionOrder(
        entries=[NextUse(session_id="a", next_use_s=5), NextUse(session_id="b", next_use_s=1)]
    )
    aged = _aged(order, 2.0)
    assert isinstance(aged, EvictionOrder) and [e.next_use_s for e in aged.entries] == [3.0, 0.0]
    assert _aged(Pin(session_id="s", ttl_s=10), 2.5) == Pin(session_id="s", ttl_s=7.5)
    assert _aged(Pin(session_id="s", ttl_s=2), 2.5) is None
    assert _aged(Pin(session_id="s", ttl_s=0), 99) == Pin(session_id="s", ttl_s=0)
    assert _aged(Priority(session_id="s", program_age_s=1), 2) == Priority(session_id="s", program_age_s=3)
    assert _aged(Prefetch(session_id="s", at_s=1), 2) == Prefetch(session_id="s", at_s=0)
    for unchanged in (Release(program_id="p"), Expect(session_id="s", output_tokens=3)):
        assert _aged(unchanged, 5) is unchanged
