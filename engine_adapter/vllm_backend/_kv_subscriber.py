"""A vLLM node's KV events, live: a ZMQ subscription applied in sequence order to a ``KvResidency``.

:class:`KvEventSubscriber` runs the SUB socket in a thread, in sequence order: a gap is filled from vLLM's
replay socket when one is configured (``replay_endpoint``; also used to catch up on start), else counted in
``missed_batches``; a sequence that starts again at 0 is a restarted publisher and clears the state.

Separate from ``_kv_events`` (the wire format and the fold, no I/O) because this is the transport: the
socket, the thread, and the sequence / replay / gap rules. Both the test process (``tests/test_vllm_*``)
and the stock-vLLM sidecar (``_kv_sidecar``) use it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ._kv_events import KvResidency, decode_event_batch

__all__ = ["KvEventSubscriber"]

log = logging.getLogger(__name__)


class KvEventSubscriber:
    """A thread that applies a vLLM node's KV events to a :class:`KvResidency`, in sequence order.

    ``endpoint``: vLLM's ``endpoint`` with ``*`` replaced by its address (``tcp://127.0.0.1:5557``), or,
    with ``bind=True``, an address to bind that vLLM's endpoint connects to. Read the residency under
    ``lock`` (or through :meth:`read`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        bind: bool = False,
        replay_endpoint: str | None = None,
        residency: KvResidency | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.residency = residency if residency is not None else KvResidency()
        self.lock = threading.Condition()
        self.next_seq: int | None = None
        self.missed_batches = 0
        self.restarts = 0
        self.last_event_s: float | None = None
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hintflow-kv-events", daemon=True)

    def start(self) -> KvEventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read(self, fn: Callable[[KvResidency], Any]) -> Any:
        with self.lock:
            return fn(self.residency)

    def wait_for(self, predicate: Callable[[KvResidency], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(residency)`` holds (checked after each batch); whether it did."""
        with self.lock:
            return self.lock.wait_for(lambda: predicate(self.residency), timeout=timeout_s)

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
                self._on_message(frames)
            except zmq.Again:
                continue
            except Exception:  # a bad message must not stop the node's view
                log.exception("hintflow: KV event message from %s failed", self.endpoint)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        with self.lock:
            if self.next_seq is not None and seq == 0 and self.next_seq > 0:
                self.restarts += 1  # the publisher started again: what we knew is gone
                self.residency.blocks.clear()
                self.residency.by_content.clear()
                self.next_seq = 0
            expected = self.next_seq
        if expected is None:
            if self.replay_endpoint:
                self._replay(0, seq)  # catch up on what was published before we subscribed
        elif seq < expected:
            return  # already applied (from a replay)
        elif seq > expected:
            if self.replay_endpoint:
                self._replay(expected, seq)
            with self.lock:
                if self.next_seq is not None and seq > self.next_seq:
                    self.missed_batches += seq - self.next_seq
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        _, events = decode_event_batch(payload)
        with self.lock:
            if self.next_seq is not None and seq < self.next_seq:
                return
            self.residency.apply_batch(events)
            self.next_seq = seq + 1
            self.last_event_s = time.monotonic()
            self.lock.notify_all()

    def _replay(self, start: int, until: int) -> None:
        """Ask vLLM's replay socket for batches ``start..until-1`` and apply them in order."""
        import zmq

        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000)):
                    break
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:
                    break  # end of replay
                if seq < until:
                    with self.lock:
                        behind = self.next_seq is not None and seq > self.next_seq
                        if behind and self.next_seq is not None:
                            self.missed_batches += seq - self.next_seq
                    self._apply(seq, frames[3])
        finally:
            sock.close(linger=0)
