"""The embedded node's ``hintflow_*`` Prometheus names, exported from inside vLLM's engine-core process.

Why a collector and an HTTP server of our own: the scheduler's sessions, pins and queues live in the
engine-core process, while vLLM's ``/metrics`` is served by the API-server process from statistics the
engine core sends it; nothing of ours travels that way. So the engine core serves ``/metrics`` on
``HINTFLOW_METRICS_PORT`` (``hintflow engine serve --backend vllm --metrics-port``), and every value is
read from live scheduler state at scrape time under the scheduler's ``hint_lock``: nothing is counted
twice or drifts, and a step pays nothing. The few things that are events rather than state (hints by
kind and result code, hint delivery latency) are tallied in :class:`HintStats` by the hint service, the
only code that applies hints. No ``prometheus_client`` metric objects are created here on purpose: with
``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for several API servers) those would write into vLLM's
multiprocess directory and show up a second time on vLLM's own ``/metrics``.

What has no meaning here, or no source without a scheduler hook (see the README): the host tier
(``hintflow_kv_host_*``, offload/reload/prefetch counters: no host tier on this backend), per-request
accounting (TTFT, queue wait, prompt tokens by source, across-turn hits: vLLM's ``vllm:*`` series cover
the first three), ``hintflow_evicted_blocks_total`` (the KV-event sidecar in ``_kv_sidecar`` counts it
from ``BlockRemoved``), ``hintflow_preemptions_total`` (``vllm:num_preemptions_total``) and the step
duration.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hints import HintDecodeError, HintModel, HintResult

if TYPE_CHECKING:
    from ._scheduler import HintflowScheduler

__all__ = ["HINT_LATENCY_BUCKETS", "HintStats", "MetricsServer", "SchedulerCollector", "start_metrics_server"]

HINT_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""The embedded node's buckets for ``hintflow_hint_delivery_latency_seconds``."""


class HintStats:
    """Hints applied, by (kind, result code), and the delivery-latency histogram; thread-safe."""

    def __init__(self, buckets: Sequence[float] = HINT_LATENCY_BUCKETS) -> None:
        self._lock = threading.Lock()
        self.buckets = tuple(buckets)
        self.by_kind_code: dict[tuple[str, str], int] = {}
        self._latency_counts = [0] * (len(self.buckets) + 1)  # the last one: +Inf
        self._latency_sum = 0.0

    def count(self, hints: Sequence[HintModel | HintDecodeError], results: Sequence[HintResult]) -> None:
        with self._lock:
            for h, res in zip(hints, results, strict=False):
                kind = (h.kind or "invalid") if isinstance(h, HintDecodeError) else h.kind
                key = (kind, res.code)
                self.by_kind_code[key] = self.by_kind_code.get(key, 0) + 1

    def observe_delivery(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # sender and node wall clocks: skew can make it negative
        with self._lock:
            self._latency_counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._latency_sum += seconds

    def snapshot(self) -> tuple[dict[tuple[str, str], int], list[int], float]:
        with self._lock:
            return dict(self.by_kind_code), list(self._latency_counts), self._latency_sum


_GAUGES = (
    ("hintflow_pinned_blocks", "Device KV blocks held by pins."),
    ("hintflow_prefill_backlog_tokens", "Prompt tokens still to compute (waiting and running)."),
    ("hintflow_num_requests_waiting", "Requests waiting to be admitted."),
    ("hintflow_num_requests_running", "Requests admitted and running."),
    ("hintflow_kv_free_blocks", "Free device KV blocks (cached-but-free ones included, as vLLM counts)."),
    ("hintflow_kv_total_blocks", "Device KV blocks (vLLM's pool less its null block)."),
    ("hintflow_pin_budget_blocks", "Most distinct blocks pins may hold (pin budget fraction of the pool)."),
    ("hintflow_sessions", "Sessions the node knows (live, parked or pinned)."),
)
_COUNTERS = (
    ("hintflow_pin_expiries_total", "Pin leases that ran out without renewal."),
    ("hintflow_pin_clamps_total", "Pins cut down to fit the pin budget."),
    ("hintflow_forced_unpins_total", "Pins dropped to break a memory deadlock."),
    ("hintflow_yielded_pins_total", "Pins dropped so that an older program's waiting turn fits."),
    ("hintflow_released_sessions_total", "Sessions freed by Release (explicit or inferred)."),
    ("hintflow_inferred_pins_total", "Pins the engine inferred for programs without an orchestrator."),
    ("hintflow_inferred_releases_total", "Releases the engine inferred (last turn, silent program)."),
    ("hintflow_admission_holds_total", "Admission checks that held a new program's first turn back."),
)


class SchedulerCollector(Collector):
    """Reads ``HintflowScheduler`` state under its ``hint_lock`` when Prometheus scrapes.

    ``hint_stats`` is called at scrape time (the hint service may start after this collector).
    """

    def __init__(self, sched: HintflowScheduler, hint_stats: Callable[[], HintStats | None]) -> None:
        self.sched = sched
        self.hint_stats = hint_stats

    def describe(self) -> Iterator[Metric]:
        """Names only, so registering does not take the scheduler lock."""
        yield from self._families(self.sched.model_name, None, None)

    def collect(self) -> Iterator[Metric]:
        sched = self.sched
        with sched.hint_lock:
            sched.book.expire()  # an idle engine does not step: leases must still run out on time
            book, st = sched.book, sched.book.stats
            inf = getattr(sched, "infer", None)
            admit: dict[str, int] = dict(getattr(sched, "admit_stats", {}))
            gauges = (
                book.num_pinned_blocks,
                sched.prefill_backlog_tokens(),
                len(sched.waiting),
                len(sched.running),
                sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                book.num_blocks,
                book.pin_budget_blocks,
                len(book.sessions),
            )
            counters = (
                st.pin_expiries,
                st.pin_clamps,
                st.forced_unpins,
                st.yielded_pins,
                st.released_sessions,
                inf.inferred_pins if inf is not None else 0,
                inf.inferred_releases if inf is not None else 0,
                admit.pop("held", 0),
            )
        yield from self._families(sched.model_name, gauges + counters, admit)

    def _families(
        self, model: str, values: tuple[int, ...] | None, admitted: dict[str, int] | None
    ) -> Iterator[Metric]:
        label = [model]
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily(n, doc, labels=["model_name"]) for n, doc in _GAUGES
        ]
        families += [CounterMetricFamily(n, doc, labels=["model_name"]) for n, doc in _COUNTERS]
        for i, fam in enumerate(families):
            if values is not None:
                fam.add_metric(label, float(values[i]))
            yield fam
        adm = CounterMetricFamily(
            "hintflow_admissions_total",
            "New programs' first turns admitted, by why: fit, idle (work conservation), aged (waited long).",
            labels=["model_name", "reason"],
        )
        for reason, n in sorted((admitted or {}).items()):
            adm.add_metric([model, reason], float(n))
        yield adm
        hints = CounterMetricFamily(
            "hintflow_hints_total",
            "Hints received, by kind and result code.",
            labels=["model_name", "kind", "code"],
        )
        latency = HistogramMetricFamily(
            "hintflow_hint_delivery_latency_seconds",
            "HintBatch.sent_unix_s to applied (sender and node wall clocks).",
            labels=["model_name"],
        )
        stats = self.hint_stats() if values is not None else None
        if stats is not None:
            by_kind, counts, total = stats.snapshot()
            for (kind, code), n in sorted(by_kind.items()):
                hints.add_metric([model, kind, code], float(n))
            cumulative, buckets = 0, []
            for bound, n in zip([*stats.buckets, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
            latency.add_metric([model], buckets, total)
        yield hints
        yield latency


@dataclass
class MetricsServer:
    registry: CollectorRegistry
    port: int
    _http: tuple[Any, threading.Thread]

    def stop(self) -> None:
        httpd, thread = self._http
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def start_metrics_server(
    sched: HintflowScheduler, port: int, host: str = "127.0.0.1", hint_stats: HintStats | None = None
) -> MetricsServer:
    """Serve ``/metrics`` for ``sched`` on ``host:port`` (0: a free port) from a daemon thread.

    ``hint_stats`` None: those of the scheduler's hint service (``sched.hint_server``), if it has one.
    """

    def stats() -> HintStats | None:
        if hint_stats is not None:
            return hint_stats
        server = getattr(sched, "hint_server", None)
        return getattr(server, "stats", None)

    registry = CollectorRegistry()
    registry.register(SchedulerCollector(sched, stats))
    http = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(registry, int(http[0].server_port), http)
