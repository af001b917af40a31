"""Deliver hints to one engine node across its restarts and outages: one :class:`HintPublisher` per node.

Why: a policy must never block on, or fail because of, a node that is slow, restarting or gone. So
``publish`` only enqueues, and one background task per node owns one ``PushHints`` stream, coalesces
queued hints into batches and resends a batch until the node acks it, reconnecting with capped
exponential backoff and jitter.

Delivery is at-least-once and in order: an acked batch is done; a batch whose push failed (the stream
broke before its ack) is sent again, though the node may already have applied it. That is harmless
because hints are idempotent leases: a pin, priority, next use or release applied twice leaves the node
as applied once, and every lease lapses on its own, so an orchestrator restart loses nothing that matters.

Durations in a hint count from its sending (the node turns them into deadlines on receipt), so a hint
that waited in the queue is aged before each (re)send: ``Pin.ttl_s``, ``NextUse.next_use_s`` and
``Prefetch.at_s`` shrink by the wait (clipped at 0), ``Priority.program_age_s`` grows by it. A pin that
lapsed while queued is dropped as expired (the node would have let it go anyway); an unpin (ttl 0) is
always delivered. Past ``max_pending`` queued hints the oldest are dropped. No drop is silent: each is
counted in ``num_dropped`` and ``hintflow_hints_dropped_total{reason="queue-full"|"expired"}``.

A node that is down is retried with backoff for as long as it stays down, so the log gets one line per
change of state (:class:`StreamHealth`: a warning when the stream fails, a line when it is back), and each
retry goes to DEBUG only. A CancelledError out of a push that the sender was not asked for (gRPC raises
one from a call cancelled under it) is a failed push like any other; a sender task that ends anyway is
logged as an error and replaced, its batch back in front of the queue.

Metrics, labelled ``node`` (the address): ``hintflow_hint_delivery_seconds`` (publish to ack, per hint),
``hintflow_hints_sent_total{code}`` (acked hints by result code), ``hintflow_hint_push_failures_total``,
``hintflow_hints_dropped_total{reason}``, ``hintflow_publisher_connected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from hints import MAX_PROGRAM_AGE_S, EngineClient, EvictionOrder, HintAck, HintModel, Pin, Prefetch, Priority

__all__ = ["NODE_CHANNEL_OPTIONS", "HintPublisher", "StreamHealth", "being_cancelled", "describe_error", "node_client"]

log = logging.getLogger(__name__)

_DELIVERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Enqueue to ack: milliseconds on a healthy loopback node, minutes across a node restart."""


class _Metrics(NamedTuple):
    delivery: Histogram
    sent: Counter
    failures: Counter
    dropped: Counter
    connected: Gauge


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()


def _metrics_for(r: CollectorRegistry) -> _Metrics:
    """One set per registry, shared by its publishers (one per node): a second set would not register."""
    if r not in _METRICS:
        _METRICS[r] = _Metrics(
            Histogram("hintflow_hint_delivery_seconds", "Publish-to-ack time of a hint.", ["node"],
                      buckets=_DELIVERY_BUCKETS, registry=r),
            Counter("hintflow_hints_sent_total", "Hints acked, by code.", ["node", "code"], registry=r),
            Counter("hintflow_hint_push_failures_total", "Failed hint pushes.", ["node"], registry=r),
            Counter("hintflow_hints_dropped_total", "Hints dropped.", ["node", "reason"], registry=r),
            Gauge("hintflow_publisher_connected", "1 while the last push was acked.", ["node"], registry=r),
        )  # fmt: skip
    return _METRICS[r]


NODE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
"""Channel options of every client the worker keeps to a node: hint stream, cache-state watch, turns.

Why: by default gRPC shares one connection per address among all of a process's channels, and with it one
reconnect backoff (1 s, growing 1.6 times per failed attempt to 120 s while the node refuses). So a node
back after an outage was reached only when that backoff ran out, by old and new channels alike, whatever
the streams' own retry schedules said: 116 s late after a 5-minute outage (4 s after one minute). A
channel with a subchannel of its own connects when asked (a fresh one at once), and its backoff stops at
2 s, the streams' own cap."""


def node_client(address: str) -> EngineClient:
    """An ``EngineClient`` for a node at ``address`` with :data:`NODE_CHANNEL_OPTIONS`."""
    return EngineClient(address, options=NODE_CHANNEL_OPTIONS)


def describe_error(exc: BaseException) -> str:
    """One line for a failed call: ``CODE: details`` for a gRPC error (its str() is a multi-line debug
    dump), else ``Type: message``."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class StreamHealth:
    """Whether one stream to one node works, logged once per change of state.

    Why: a node that is down is retried with backoff (every couple of seconds) for as long as it is down,
    by the hint publisher and by the runtime's cache-state watch alike; a line per attempt would fill an
    operator's log with the same news.  So: a warning when the stream goes down (or cannot be opened at
    all), one line when it is back (how long it was down, how many attempts failed), DEBUG in between.
    """

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what, self._log = what, logger
        self.down_since: float | None = None  # time.monotonic() of the first failure of this outage
        self.failures = 0  # failed attempts in this outage

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, error: str, retry_in_s: float) -> None:
        """An attempt failed; the next one is in ``retry_in_s``."""
        self.failures += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            self._log.warning("%s failed (%s); retrying with backoff", self.what, error)
        else:
            self._log.debug(
                "%s: attempt %d failed (%s); next in %.2f s", self.what, self.failures, error, retry_in_s
            )

    def ok(self) -> None:
        """The stream works (again)."""
        if self.down_since is None:
            return
        down_s = time.monotonic() - self.down_since
        self._log.info("%s back after %.1f s, %d failed attempts", self.what, down_s, self.failures)
        self.down_since, self.failures = None, 0


@dataclass(frozen=True)
class _Item:
    seq: int
    hint: HintModel  # as published; aged afresh at every send
    enqueued_s: float  # time.monotonic()
    node_epoch: int = 0  # the node's life when it was published (0: not known yet: any)


def being_cancelled() -> bool:
    """Whether the running task has been asked to stop (``Task.cancel``), as against a CancelledError that
    a library raised into it from a call cancelled elsewhere."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _aged(hint: HintModel, w: float) -> HintModel | None:
    """``hint`` as it should be sent ``w`` seconds after it was published; None: a pin that has lapsed."""
    if w <= 0:
        return hint
    if isinstance(hint, Pin):
        if hint.ttl_s == 0:
            return hint  # an unpin stays an unpin
        ttl = hint.ttl_s - w
        return hint.model_copy(update={"ttl_s": ttl}) if ttl > 0 else None
    if isinstance(hint, Priority):
        return hint.model_copy(update={"program_age_s": min(hint.program_age_s + w, MAX_PROGRAM_AGE_S)})
    if isinstance(hint, Prefetch):
        return hint.model_copy(update={"at_s": max(0.0, hint.at_s - w)})
    if isinstance(hint, EvictionOrder):
        entries = [e.model_copy(update={"next_use_s": max(0.0, e.next_use_s - w)}) for e in hint.entries]
        return hint.model_copy(update={"entries": entries})
    return hint  # Expect, Release: nothing time-relative


class HintPublisher:
    """Queue hints for the node at ``address`` and deliver them from a background task; see the module doc.

    Plain counters, for tests and reports: ``num_sent`` (hints acked, any code), ``num_acked_ok`` (acked
    with code OK), ``num_failures`` (failed batch pushes), ``num_dropped`` (queue full or lapsed pin) and
    ``num_sender_restarts`` (sender tasks that ended while the publisher was open, each logged as an error
    and replaced after ``backoff_max_s``).
    """

    def __init__(
        self,
        address: str,
        *,
        registry: CollectorRegistry | None = None,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        max_pending: int = 10_000,
        max_batch: int = 256,
        ack_timeout_s: float = 10.0,
        on_ack: Callable[[list[HintModel], HintAck], None] | None = None,
        on_drop: Callable[[list[HintModel], str], None] | None = None,
        client_factory: Callable[[str], EngineClient] = node_client,
    ) -> None:
        if max_pending < 1 or max_batch < 1 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need max_pending, max_batch >= 1 and 0 < backoff_initial_s <= backoff_max_s")
        self.address = address
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.max_pending, self.max_batch, self.ack_timeout_s = max_pending, max_batch, ack_timeout_s
        self.on_ack, self.on_drop, self._client_factory = on_ack, on_drop, client_factory
        m = _metrics_for(REGISTRY if registry is None else registry)
        self._metrics, self._connected_gauge = m, m.connected.labels(node=address)
        self._connected_gauge.set(0)
        self._queue: deque[_Item] = deque()  # waiting, oldest first (a failed batch goes back in front)
        self._inflight: list[_Item] = []  # the batch being pushed; older than everything in _queue
        self._seq = 0  # of the last hint published
        self._wakeup, self._progress = asyncio.Event(), asyncio.Event()
        self._client: EngineClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = self._connected = self._warned_full = False
        self.health = StreamHealth(f"hint stream to {address}")
        self.num_sent = self.num_acked_ok = self.num_failures = self.num_dropped = 0
        self.num_sender_restarts = 0  # sender tasks that ended while the publisher was open (see _sender_ended)
        # The node's life as last heard (an ack, or the runtime's cache-state watch); 0: not yet. Hints are
        # stamped with it, and those stamped with an earlier life are dropped once a new one is heard of.
        self.node_epoch = 0

    @property
    def connected(self) -> bool:
        """True while the last push was acked; False before the first ack and after a failed push."""
        return self._connected

    @property
    def num_pending(self) -> int:
        """Hints published but neither acked nor dropped yet (queued or in flight)."""
        return len(self._queue) + len(self._inflight)

    def _set_connected(self, value: bool) -> None:
        self._connected = value
        self._connected_gauge.set(1 if value else 0)

    def start(self) -> None:
        """Start the sender task in the running event loop (no-op if started)."""
        if self._closed:
            raise RuntimeError("HintPublisher is closed")
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=f"hint-publisher {self.address}")
            self._task.add_done_callback(self._sender_ended)

    def publish(self, hints: Sequence[HintModel]) -> None:
        """Enqueue ``hints`` (in order) for delivery; never blocks, never waits for the node."""
        if self._closed:
            raise RuntimeError("HintPublisher is closed")
        now = time.monotonic()
        for hint in hints:
            self._seq += 1
            self._queue.append(_Item(self._seq, hint, now, self.node_epoch))
        self._enforce_bound()
        self._wakeup.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every hint published so far was acked (or dropped, and counted); False on timeout."""
        target = self._seq
        try:
            async with asyncio.timeout(timeout_s):
                while self._oldest_pending_seq() <= target:
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop the sender, close the stream; pending hints are abandoned (flush first). Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        # Cancel until it is done: a cancellation that lands while gRPC closes a channel can be swallowed
        # there (the sender then went on retrying, and a close waited forever: seen once in CI); the
        # sender also stops by itself at its next turn once closed.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=1.0)
        if task is not None and not task.cancelled():
            with contextlib.suppress(Exception):
                task.result()
        await self._drop_client()
        self._set_connected(False)

    def note_node_epoch(self, epoch: int) -> None:
        """The node is (now) in life ``epoch``: hints queued for an earlier life are dropped (the node came
        back empty: its sessions are gone), the rest and later ones are stamped with it."""
        if epoch == 0 or epoch == self.node_epoch:
            return
        earlier, self.node_epoch = self.node_epoch, epoch
        if earlier == 0:
            return
        stale = [i.hint for i in self._queue if i.node_epoch not in (0, epoch)]
        if stale:
            self._queue = deque(i for i in self._queue if i.node_epoch in (0, epoch))
            log.info("node %s restarted (epoch %d -> %d): %d queued hints for its earlier life dropped",
                     self.address, earlier, epoch, len(stale))
            self._drop(stale, "restarted")

    def _oldest_pending_seq(self) -> int:
        if self._inflight:
            return self._inflight[0].seq
        return self._queue[0].seq if self._queue else self._seq + 1

    def _drop(self, dropped: list[HintModel], reason: str) -> None:
        """Count hints that will never be sent (``on_drop`` gets them as published, before aging)."""
        if not dropped:
            return
        n = len(dropped)
        self.num_dropped += n
        self._metrics.dropped.labels(node=self.address, reason=reason).inc(n)
        self._progress.set()
        if self.on_drop is not None:
            try:
                self.on_drop(dropped, reason)
            except Exception:
                log.exception("on_drop callback failed")

    def _enforce_bound(self) -> None:
        excess = len(self._queue) - self.max_pending
        dropped = [self._queue.popleft().hint for _ in range(excess)]
        if excess > 0:  # warn once until the next ack, then only count
            level, self._warned_full = logging.DEBUG if self._warned_full else logging.WARNING, True
            log.log(level, "hint queue for %s full (%d): dropping the oldest", self.address, self.max_pending)
            self._drop(dropped, "queue-full")

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    def _take_batch(self) -> tuple[list[_Item], list[HintModel]]:
        """Move up to ``max_batch`` hints of one node epoch to the in-flight batch, aged to now; lapsed pins
        are dropped."""
        now = time.monotonic()
        items: list[_Item] = []
        hints: list[HintModel] = []
        expired: list[HintModel] = []
        epoch = self._queue[0].node_epoch if self._queue else 0
        while self._queue and len(items) < self.max_batch and self._queue[0].node_epoch == epoch:
            item = self._queue.popleft()
            hint = _aged(item.hint, now - item.enqueued_s)
            if hint is None:
                expired.append(item.hint)
                continue
            items.append(item)
            hints.append(hint)
        self._drop(expired, "expired")
        self._inflight = items
        return items, hints

    def _on_acked(self, items: list[_Item], hints: list[HintModel], ack: HintAck) -> None:
        now = time.monotonic()
        for item in items:
            self._metrics.delivery.labels(node=self.address).observe(now - item.enqueued_s)
        for result in ack.results:
            self._metrics.sent.labels(node=self.address, code=result.code).inc()
            self.num_acked_ok += int(result.ok)
        self.num_sent += len(items)
        if len(ack.results) != len(items):
            log.warning("node %s acked %d of %d hints", self.address, len(ack.results), len(items))
        if self.on_ack is not None:
            try:
                self.on_ack(hints, ack)
            except Exception:
                log.exception("on_ack callback failed")
        self._progress.set()

    async def _push_failed(self, items: list[_Item], error: str, failed: int) -> None:
        """Put the batch back in front (resent in order, aged afresh; may drop the oldest), count the
        failure, drop the channel and back off: ``failed`` consecutive failures so far."""
        self._queue.extendleft(reversed(items))
        self._inflight = []
        self._enforce_bound()
        self.num_failures += 1
        self._metrics.failures.labels(node=self.address).inc()
        self._set_connected(False)
        await self._drop_client()  # a fresh channel connects at once, not after gRPC's own backoff
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** min(failed - 1, 60))
        delay *= random.uniform(0.5, 1.0)
        self.health.failed(error, delay)
        await asyncio.sleep(delay)

    def _sender_ended(self, task: asyncio.Task[None]) -> None:
        """The sender task ended while the publisher is open (a bug, or a cancellation it did not see
        coming): say so and start another after ``backoff_max_s``, its batch back in front of the queue.
        Why: without a sender nothing reaches the node again, and nothing else would notice."""
        if self._closed or task is not self._task:
            return
        exc = None if task.cancelled() else task.exception()
        log.error("hint sender for %s stopped (%s); starting another in %.1f s", self.address,
                  "cancelled" if exc is None else describe_error(exc), self.backoff_max_s)
        self._queue.extendleft(reversed(self._inflight))
        self._inflight, self._task = [], None
        self.num_sender_restarts += 1
        asyncio.get_running_loop().call_later(self.backoff_max_s, self._restart)

    def _restart(self) -> None:
        if not self._closed and self._task is None:
            self.start()

    async def _run(self) -> None:
        failed = 0  # consecutive failed pushes: 0 while healthy
        while not self._closed:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            items, hints = self._take_batch()
            if not items:
                continue
            try:
                if self._client is None:
                    self._client = self._client_factory(self.address)
                epoch = items[0].node_epoch
                ack = await asyncio.wait_for(self._client.push_hints(hints, node_epoch=epoch), self.ack_timeout_s)
            except asyncio.CancelledError:
                if self._closed or being_cancelled():
                    raise
                # gRPC raises CancelledError from a call that was cancelled under it, not by us: a failed
                # push like any other, not the end of the sender (nothing would reach this node again).
                failed += 1
                await self._push_failed(items, "CancelledError: the call was cancelled under the push", failed)
                continue
            except Exception as e:  # grpc.aio.AioRpcError, ConnectionError, TimeoutError
                failed += 1
                await self._push_failed(items, describe_error(e), failed)
                continue
            self._inflight = []
            self.health.ok()
            failed, self._warned_full = 0, False
            self._set_connected(True)
            self._on_acked(items, hints, ack)
            self.note_node_epoch(ack.node_epoch)
