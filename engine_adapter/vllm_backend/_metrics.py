"""The embedded node's ``hintflow_*`` Prometheus names, exported from inside vLLM's engine-core process.

Why a collector and an HTTP server of our own: the scheduler's sessions, pins and queues live in the
engine-core process, while vLLM's ``/metrics`` is served by the API-server process from statistics the
engine core sends it; nothing of ours travels that way. So the engine core serves ``/metrics`` on
``HINTFLOW_METRICS_PORT`` (``hintflow engine serve --backend vllm --metrics-port``), and every value is
read from live scheduler state at scrape time under the scheduler's ``hint_lock``: nothing is counted
twice or drifts. The things that are events rather than state are tallied where they happen: hints by
kind and result code and their delivery latency in :class:`HintStats` by the hint service (the only code
that applies hints); per-request accounting (prompt tokens by source, across-turn and within-turn hits,
recomputed tokens, TTFT, queue wait) in the scheduler's :class:`~._accounting.RequestAccounting`, when
vLLM first schedules a request and when its first token comes out (a common-prefix compare per new
request, a look at the requests still without a token per step), copied here under the same lock.
No ``prometheus_client`` metric objects are created here on purpose: with ``PROMETHEUS_MULTIPROC_DIR``
set (vLLM sets it for several API servers) those would write into vLLM's multiprocess directory and show
up a second time on vLLM's own ``/metrics``.

The host tier (``hintflow_kv_host_*``, ``hintflow_offloaded_blocks_total`` (here: copied to the host as they
fill), ``hintflow_reloaded_blocks_total``, ``hintflow_dropped_host_blocks_total``, ``host_hit`` prompt tokens) is read from hintflow's host
KV connector (``_host_connector``) when the server runs one, and is absent otherwise. What has no
source without a scheduler hook (see docs/metrics.md): ``hintflow_evicted_blocks_total`` (the KV-event sidecar in ``_kv_sidecar``
counts it from ``BlockRemoved``), ``hintflow_preemptions_total`` (``vllm:num_preemptions_total``) and
the step duration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter._lost_context import LOST_METRIC
from hints import HintDecodeError, HintModel, HintResult

from ._accounting import Histogram, RequestAccounting

if TYPE_CHECKING:
    from ._hint_scheduler import HintSchedulerMixin

__all__ = ["HINT_LATENCY_BUCKETS", "HintStats", "MetricsServer", "SchedulerCollector", "start_metrics_server"]

HINT_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""The embedded node's buckets for ``hintflow_hint_delivery_latency_seconds``."""


class HintStats:
    """Hints applied, by (kind, result code), and the delivery-latency histogram; thread-safe."""

    def __init__(self, buckets: Sequence[float] = HINT_LATENCY_BUCKETS) -> None:
        self._lock = threading.Lock()
        self.by_kind_code: dict[tuple[str, str], int] = {}
        self._latency = Histogram(buckets)

    def count(self, hints: Sequence[HintModel | HintDecodeError], results: Sequence[HintResult]) -> None:
        with self._lock:
            for h, res in zip(hints, results, strict=False):
                kind = (h.kind or "invalid") if isinstance(h, HintDecodeError) else h.kind
                key = (kind, res.code)
                self.by_kind_code[key] = self.by_kind_code.get(key, 0) + 1

    def observe_delivery(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # sender and node wall clocks: skew can make it negative
        with self._lock:
            self._latency.observe(seconds)

    def snapshot(self) -> tuple[dict[tuple[str, str], int], Histogram]:
        with self._lock:
            return dict(self.by_kind_code), self._latency.copy()


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
    ("hintflow_pin_renewals_total", "Inferred pins renewed when they ran out with the pause still on."),
    ("hintflow_admission_holds_total", "Admission checks that held a new program's first turn back."),
)


class SchedulerCollector(Collector):
    """Reads the scheduler's state (``HintSchedulerMixin``) under its ``hint_lock`` when Prometheus scrapes.

    ``hint_stats`` is called at scrape time (the hint service may start after this collector).
    """

    def __init__(self, sched: HintSchedulerMixin, hint_stats: Callable[[], HintStats | None]) -> None:
        self.sched = sched
        self.hint_stats = hint_stats

    def describe(self) -> Iterator[Metric]:
        """Names only, so registering does not take the scheduler lock."""
        yield from self._families(self.sched.model_name, None, None)
        yield from _request_families(self.sched.model_name, None)

    def collect(self) -> Iterator[Metric]:
        sched = self.sched
        with sched.hint_lock:
            sched.expire_pins()  # an idle engine does not step: leases must still run out on time
            book, st = sched.book, sched.book.stats
            inf = getattr(sched, "infer", None)
            admit: dict[str, int] = dict(getattr(sched, "admit_stats", {}))
            acct: RequestAccounting = sched.accounting.snapshot()
            tier = getattr(sched, "host_tier", None)
            host = None
            if tier is not None:
                idx = tier.index
                host = (idx.num_slots, idx.num_slots - idx.num_used_slots, idx.stats.num_saved_blocks,
                        idx.stats.num_loaded_blocks, idx.stats.num_evicted_blocks)  # fmt: skip
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
                st.pin_renewals,
                admit.pop("held", 0),
            )
        yield from self._families(sched.model_name, gauges + counters, admit)
        yield from _request_families(sched.model_name, acct)
        if host is not None:
            yield from _host_families(sched.model_name, host)

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
            by_kind, hist = stats.snapshot()
            for (kind, code), n in sorted(by_kind.items()):
                hints.add_metric([model, kind, code], float(n))
            latency.add_metric([model], hist.cumulative(), hist.sum)
        yield hints
        yield latency


_REQUEST_COUNTERS = (
    ("hintflow_across_turn_prompt_tokens_total", "Prompt tokens the session computed in an earlier turn."),
    ("hintflow_across_turn_hit_tokens_total", "Across-turn prompt tokens found cached (device or host)."),
    ("hintflow_within_turn_hit_tokens_total", "Cache hits not from the session's own history (e.g. a shared prefix)."),
    ("hintflow_recomputed_tokens_total", "Across-turn prompt tokens recomputed because their KV was evicted."),
)


def _request_families(model: str, acct: RequestAccounting | None) -> Iterator[Metric]:
    """The embedded engine's per-request series (names, labels, help and buckets as there)."""
    by_source = ["model_name", "source"]
    doc = "Prompt tokens by where their KV came from."
    prompt = CounterMetricFamily("hintflow_prompt_tokens_total", doc, labels=by_source)
    counters = [CounterMetricFamily(n, doc, labels=["model_name"]) for n, doc in _REQUEST_COUNTERS]
    ttft = HistogramMetricFamily(
        "hintflow_time_to_first_token_seconds", "Arrival to first output token.", labels=["model_name"]
    )
    wait = HistogramMetricFamily(
        "hintflow_queue_wait_seconds", "Arrival to first scheduled step.", labels=["model_name"]
    )
    lost = CounterMetricFamily(*LOST_METRIC, labels=["model_name", "cause"])
    if acct is not None:
        sources = {"device_hit": acct.device_hit_tokens, "host_hit": acct.host_hit_tokens, "computed": acct.computed_tokens}
        for source, n in sources.items():
            prompt.add_metric([model, source], float(n))
        values = (
            acct.across_turn_prompt_tokens,
            acct.across_turn_hit_tokens,
            acct.within_turn_hit_tokens,
            acct.recomputed_tokens,
        )
        for fam, value in zip(counters, values, strict=True):
            fam.add_metric([model], float(value))
        ttft.add_metric([model], acct.ttft.cumulative(), acct.ttft.sum)
        wait.add_metric([model], acct.queue_wait.cumulative(), acct.queue_wait.sum)
        for cause, n in sorted(acct.lost_by.items()):
            lost.add_metric([model, cause], float(n))
    yield prompt
    yield from counters
    yield lost
    yield ttft
    yield wait


_HOST = (
    (GaugeMetricFamily, "hintflow_kv_host_total_blocks", "Host-tier KV blocks."),
    (GaugeMetricFamily, "hintflow_kv_host_free_blocks", "Free host-tier KV blocks."),
    (CounterMetricFamily, "hintflow_offloaded_blocks_total", "Device KV blocks copied to the host tier."),
    (CounterMetricFamily, "hintflow_reloaded_blocks_total", "Host KV blocks copied back to the device for a prompt."),
    (CounterMetricFamily, "hintflow_dropped_host_blocks_total", "Host-tier KV blocks dropped to make room."),
)


def _host_families(model: str, values: tuple[int, ...]) -> Iterator[Metric]:
    """The host tier's series, as the embedded engine names them (only where a host tier runs)."""
    for (kind, name, doc), value in zip(_HOST, values, strict=True):
        fam = kind(name, doc, labels=["model_name"])
        fam.add_metric([model], float(value))
        yield fam


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
    sched: HintSchedulerMixin, port: int, host: str = "127.0.0.1", hint_stats: HintStats | None = None
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
