"""A ``CacheState`` sidecar for a stock vLLM, served as hintflow's gRPC service and ``hintflow_*`` metrics.

``python -m engine_adapter.vllm_backend._kv_sidecar`` (or :func:`serve_sidecar`) serves a
:class:`VllmCacheStateSource` as ``GetCacheState`` / ``WatchCacheState`` beside a stock vLLM, so the
orchestrator's router sees it like any node; its ``PushHints`` answers UNIMPLEMENTED for each hint (stock
vLLM cannot enforce them). With a metrics port it also serves the ``hintflow_*`` series the KV events
give (evicted blocks above all: vLLM evicts inside its block pool with no hook).

Separate from ``_kv_events`` (the fold), ``_kv_subscriber`` (the transport) and ``_kv_state`` (the state)
because only a stock vLLM needs it: a node running hintflow's scheduler serves its state from
``_hint_service`` instead.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hints import (
    HintAck,
    HintResult,
    ack_to_proto,
    batch_from_proto_lenient,
    cache_state_to_proto,
    engine_pb2_grpc,
)

from ._cache_state import serve_watch
from ._hint_service import bind_engine_node
from ._kv_events import GPU
from ._kv_state import VllmCacheStateSource
from ._kv_subscriber import KvEventSubscriber

__all__ = ["Sidecar", "main", "serve_sidecar"]


class _KvEventCollector(Collector):
    """``hintflow_*`` series the sidecar can derive from the events (evictions above all)."""

    def __init__(self, subscriber: KvEventSubscriber, model_name: Callable[[], str]) -> None:
        self.subscriber = subscriber
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        with self.subscriber.lock:
            res, sub = self.subscriber.residency, self.subscriber
            removed = dict(res.stats.removed_blocks)
            values = (res.num_resident(GPU), res.stats.stored_blocks, sub.missed_batches, len(res.sessions))
        label = [self.model_name()]
        resident = GaugeMetricFamily(
            "hintflow_kv_cached_blocks", "Device blocks in vLLM's prefix cache.", labels=["model_name"]
        )
        resident.add_metric(label, float(values[0]))
        yield resident
        evicted = CounterMetricFamily(
            "hintflow_evicted_blocks_total",
            "Device KV blocks evicted (vLLM BlockRemoved, GPU).",
            labels=["model_name"],
        )
        evicted.add_metric(label, float(removed.get(GPU, 0)))
        yield evicted
        for name, doc, v in (
            ("hintflow_kv_event_stored_blocks_total", "Blocks vLLM reported stored (any medium).", values[1]),
            (
                "hintflow_kv_event_missed_batches_total",
                "KV event batches lost (sequence gaps not replayed).",
                values[2],
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric(label, float(v))
            yield fam
        sessions = GaugeMetricFamily(
            "hintflow_sessions", "Sessions seen in KV events (bounded).", labels=["model_name"]
        )
        sessions.add_metric(label, float(values[3]))
        yield sessions


class _SidecarServicer(engine_pb2_grpc.EngineNodeServicer):  # type: ignore[misc]
    def __init__(self, source: VllmCacheStateSource, watch_min_period_s: float = 0.05) -> None:
        self.source = source
        self.watch_min_period_s = watch_min_period_s
        self.closing = threading.Event()

    def GetCacheState(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cache_state_to_proto(self.source.state(request.include_sessions))

    def WatchCacheState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from serve_watch(self.source, request, context, 1.0, self.watch_min_period_s, self.closing)

    def PushHints(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        msg = "stock vLLM behind a KV-event sidecar: hints are not enforced (serve with hintflow's scheduler)"
        for batch in request_iterator:
            decoded = batch_from_proto_lenient(batch)
            results = [
                HintResult(index=i, code="UNIMPLEMENTED", message=msg) for i in range(len(decoded.hints))
            ]
            yield ack_to_proto(HintAck(batch_id=decoded.batch_id, results=results))


@dataclass
class Sidecar:
    server: grpc.Server
    port: int
    servicer: _SidecarServicer
    subscriber: KvEventSubscriber
    metrics_port: int | None = None
    own_subscriber: bool = True
    _http: tuple[Any, threading.Thread] | None = None

    def stop(self) -> None:
        self.servicer.closing.set()
        self.server.stop(grace=0.5).wait()
        if self._http is not None:
            self._http[0].shutdown()
            self._http[0].server_close()
        if self.own_subscriber:
            self.subscriber.stop()


def serve_sidecar(
    subscriber: KvEventSubscriber,
    metrics_url: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    own_subscriber: bool = True,
    **source_kw: Any,
) -> Sidecar:
    """Start ``subscriber`` (if not yet) and serve its node's CacheState over gRPC on ``host:port``.

    ``metrics_port`` (0: a free one) serves the ``hintflow_*`` series the events give (evicted blocks
    above all); ``own_subscriber``: :meth:`Sidecar.stop` stops the subscriber too.
    """
    if not subscriber._thread.is_alive():
        subscriber.start()
    source = VllmCacheStateSource(subscriber, metrics_url, **source_kw)
    servicer = _SidecarServicer(source)
    server, bound = bind_engine_node(servicer, host, port, "KV-event sidecar", "hintflow-kv")
    http = None
    if metrics_port is not None and metrics_port >= 0:
        registry = CollectorRegistry()
        registry.register(
            _KvEventCollector(
                subscriber, lambda: source.model_name or str(source._metrics.get("model_name", ""))
            )
        )
        http = start_http_server(metrics_port, addr=host, registry=registry)
    server.start()
    mport = int(http[0].server_port) if http is not None else None
    return Sidecar(server, bound, servicer, subscriber, mport, own_subscriber, http)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine_adapter.vllm_backend._kv_sidecar",
        description="CacheState of a (stock) vLLM node from its KV events, served as hintflow's "
        "GetCacheState/WatchCacheState for the orchestrator's router.",
    )
    ap.add_argument("--events", required=True, help="vLLM's KV event endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--bind", action="store_true", help="bind --events (vLLM's endpoint then connects here)")
    ap.add_argument("--topic", default="", help="vLLM's kv-events topic")
    ap.add_argument("--replay", default=None, help="vLLM's replay_endpoint, to catch up and fill gaps")
    ap.add_argument("--vllm-url", default=None, help="vLLM's HTTP base URL, for /metrics (queues, usage)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port of the sidecar (0: any free one)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve hintflow_* metrics here")
    ap.add_argument("--node-id", default="vllm")
    ap.add_argument("--total-blocks", type=int, default=0, help="pool size if vLLM's /metrics is not read")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    sub = KvEventSubscriber(a.events, topic=a.topic, bind=a.bind, replay_endpoint=a.replay)
    url = a.vllm_url.rstrip("/") + "/metrics" if a.vllm_url else None
    car = serve_sidecar(
        sub,
        url,
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        node_id=a.node_id,
        total_blocks=a.total_blocks,
    )
    print(f"hintflow KV-event sidecar for {a.events}: CacheState on {a.host}:{car.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    car.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
