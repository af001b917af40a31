"""Prometheus metrics of one engine node, named to sit beside vLLM's ``vllm:*`` in one dashboard.

Conventions (docs/architecture.md, docs/metrics.md): prefix ``hintflow_``, base units, counters end in ``_total``, durations in
``_seconds``, and every series carries ``model_name`` as vLLM's do.

Two kinds of source, so nothing is counted twice:

- events the engine reports to an observer (a request finished, a step ran, hints were applied) feed
  ordinary histograms and counters as they happen;
- everything the engine already counts itself (queue lengths, free blocks, ``KVStats``, preemptions) is
  read at scrape time by a custom collector, so it costs nothing per step and cannot drift.

Prompt-token accounting, per admitted request (hits are always a prefix of the prompt)::

    prompt = device_hit + host_hit + computed
    history (tokens this session computed in an earlier turn) = across_turn_hit + recomputed
    within_turn_hit = (device_hit + host_hit) - across_turn_hit     (e.g. a shared system prompt)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hints import HintDecodeError, HintModel, HintResult

from ._lost_context import LOST_METRIC

if TYPE_CHECKING:
    from ._engine import EngineCore
    from ._executor import ScheduledBatch, StepOutput
    from ._scheduler import Request

__all__ = ["EngineMetrics"]

# Seconds: a tiny CPU model answers in milliseconds, a long cold prefill behind a backlog in minutes.
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_HINT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _ScrapeCollector(Collector):
    """Reads the engine's own counters and gauges under its lock when Prometheus scrapes."""

    _GAUGES = (
        ("hintflow_pinned_blocks", "Device KV blocks held by pins."),
        ("hintflow_prefill_backlog_tokens", "Prompt tokens still to compute (waiting and running)."),
        ("hintflow_num_requests_waiting", "Requests waiting to be admitted."),
        ("hintflow_num_requests_running", "Requests admitted and running."),
        ("hintflow_kv_free_blocks", "Free device KV blocks."),
        ("hintflow_kv_total_blocks", "Device KV blocks."),
        ("hintflow_kv_host_free_blocks", "Free host-tier KV blocks."),
        ("hintflow_kv_host_total_blocks", "Host-tier KV blocks."),
    )
    _COUNTERS = (
        ("hintflow_pin_expiries_total", "Pin leases that ran out without renewal."),
        ("hintflow_pin_clamps_total", "Pins cut down to fit the pin budget."),
        ("hintflow_forced_unpins_total", "Pins dropped to break a memory deadlock."),
        ("hintflow_yielded_pins_total", "Pins dropped so that an older program's waiting turn fits."),
        ("hintflow_evicted_blocks_total", "Device KV blocks evicted (offloaded or dropped)."),
        ("hintflow_evicted_sessions_total", "Session contexts that lost their last device block."),
        ("hintflow_offloaded_blocks_total", "Device KV blocks copied to the host tier on eviction."),
        ("hintflow_reloaded_blocks_total", "Host KV blocks copied back to the device for a prompt."),
        ("hintflow_prefetched_blocks_total", "Host KV blocks copied back ahead of use by a Prefetch hint."),
        ("hintflow_dropped_host_blocks_total", "Host-tier KV blocks dropped to make room."),
        ("hintflow_preemptions_total", "Running requests preempted for memory."),
        ("hintflow_admission_holds_total", "Admission checks that held a new program's first turn back."),
    )
    _ADMISSIONS = (
        "hintflow_admissions_total",
        "New programs' first turns admitted, by why: fit, idle (work conservation), aged (waited long).",
    )

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def _families(self) -> tuple[list[GaugeMetricFamily], list[CounterMetricFamily]]:
        gauges = [GaugeMetricFamily(n, doc, labels=["model_name"]) for n, doc in self._GAUGES]
        counters = [CounterMetricFamily(n, doc, labels=["model_name"]) for n, doc in self._COUNTERS]
        return gauges, counters

    def describe(self) -> Iterator[Metric]:
        """Names only, so registering does not take the engine lock."""
        gauges, counters = self._families()
        yield from gauges
        yield from counters
        yield CounterMetricFamily(*self._ADMISSIONS, labels=["model_name", "reason"])
        yield CounterMetricFamily(*LOST_METRIC, labels=["model_name", "cause"])

    def collect(self) -> Iterator[Metric]:
        core = self.core
        with core.lock:
            kv, sched, st = core.kv, core.scheduler, core.kv.stats
            gauge_values = (
                kv.num_pinned_blocks,
                sched.prefill_backlog_tokens(),
                sched.num_waiting,
                sched.num_running,
                kv.device.num_free_blocks,
                kv.device.num_blocks,
                kv.host.num_free_blocks,
                kv.host.num_blocks,
            )
            counter_values = (
                st.pin_expiries,
                st.pin_clamps,
                st.forced_unpins,
                st.yielded_pins,
                st.evicted_blocks,
                st.evicted_sessions,
                st.offloaded_blocks,
                st.reloaded_blocks,
                st.prefetched_blocks,
                st.dropped_host_blocks,
                sched.num_preemptions,
                sched.admit_stats["held"],
            )
            admitted = {k: v for k, v in sched.admit_stats.items() if k != "held"}
            lost_by = dict(st.lost_by)
        gauges, counters = self._families()
        label = [core.model_name]
        families: list[GaugeMetricFamily | CounterMetricFamily] = [*gauges, *counters]
        for fam, value in zip(families, gauge_values + counter_values, strict=True):
            fam.add_metric(label, float(value))
            yield fam
        adm = CounterMetricFamily(*self._ADMISSIONS, labels=["model_name", "reason"])
        for reason, n in sorted(admitted.items()):
            adm.add_metric([core.model_name, reason], float(n))
        yield adm
        lost = CounterMetricFamily(*LOST_METRIC, labels=["model_name", "cause"])
        for cause, n in sorted(lost_by.items()):
            lost.add_metric([core.model_name, cause], float(n))
        yield lost


class EngineMetrics:
    """An ``EngineObserver`` that exports the node's metrics; registers itself in ``core.observers``.

    ``registry=None`` makes a fresh registry rather than using the process-global one: several nodes in one
    process (tests, replay) would otherwise collide on metric names.
    """

    def __init__(self, core: EngineCore, registry: CollectorRegistry | None = None) -> None:
        self.core = core
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "hintflow_time_to_first_token_seconds",
            "Arrival to first output token.",
            m,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_wait = Histogram(
            "hintflow_queue_wait_seconds",
            "Arrival to first scheduled step.",
            m,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.step_duration = Histogram(
            "hintflow_step_duration_seconds",
            "One engine step (copies + forward).",
            m,
            registry=r,
            buckets=_STEP_BUCKETS,
        )
        self.hint_latency = Histogram(
            "hintflow_hint_delivery_latency_seconds",
            "HintBatch.sent_unix_s to applied (sender and node wall clocks).",
            m,
            registry=r,
            buckets=_HINT_BUCKETS,
        )
        self.request_success = Counter(
            "hintflow_request_success_total", "Finished requests.", [*m, "finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "hintflow_prompt_tokens_total",
            "Prompt tokens by where their KV came from.",
            [*m, "source"],
            registry=r,
        )
        self.across_prompt = Counter(
            "hintflow_across_turn_prompt_tokens_total",
            "Prompt tokens the session computed in an earlier turn.",
            m,
            registry=r,
        )
        self.across_hit = Counter(
            "hintflow_across_turn_hit_tokens_total",
            "Across-turn prompt tokens found cached (device or host).",
            m,
            registry=r,
        )
        self.within_hit = Counter(
            "hintflow_within_turn_hit_tokens_total",
            "Cache hits not from the session's own history (e.g. a shared prefix).",
            m,
            registry=r,
        )
        self.recomputed = Counter(
            "hintflow_recomputed_tokens_total",
            "Across-turn prompt tokens recomputed because their KV was evicted.",
            m,
            registry=r,
        )
        self.generation_tokens = Counter(
            "hintflow_generation_tokens_total", "Output tokens generated.", m, registry=r
        )
        self.hints = Counter(
            "hintflow_hints_total",
            "Hints received, by kind and result code.",
            [*m, "kind", "code"],
            registry=r,
        )
        r.register(_ScrapeCollector(core))
        name = core.model_name
        self._sources = {
            s: self.prompt_tokens.labels(name, s) for s in ("device_hit", "host_hit", "computed")
        }
        core.observers.append(self)

    # ---- EngineObserver (called under the engine lock: keep these cheap) -------------------------
    def on_request_finished(self, req: Request) -> None:
        name = self.core.model_name
        self.request_success.labels(name, req.finish_reason or "unknown").inc()
        if req.output:
            self.generation_tokens.labels(name).inc(len(req.output))
        if req.ttft_s is not None:
            self.ttft.labels(name).observe(req.ttft_s)
        if not req.admitted:  # aborted in the queue: no prompt token was looked up or computed
            return
        self.queue_wait.labels(name).observe(req.queue_wait_s)
        hits = req.num_cached_tokens + req.num_host_hit_tokens
        self._sources["device_hit"].inc(req.num_cached_tokens)
        self._sources["host_hit"].inc(req.num_host_hit_tokens)
        self._sources["computed"].inc(max(0, len(req.prompt) - hits))
        across_hit = min(hits, req.num_history_tokens)
        self.across_prompt.labels(name).inc(req.num_history_tokens)
        self.across_hit.labels(name).inc(across_hit)
        self.within_hit.labels(name).inc(hits - across_hit)
        self.recomputed.labels(name).inc(req.num_recomputed_tokens)

    def on_step(self, batch: ScheduledBatch, out: StepOutput) -> None:
        self.step_duration.labels(self.core.model_name).observe(out.elapsed_s)

    def on_hints(self, hints: Sequence[HintModel | HintDecodeError], results: Sequence[HintResult]) -> None:
        name = self.core.model_name
        for h, res in zip(hints, results, strict=False):
            kind = (h.kind or "invalid") if isinstance(h, HintDecodeError) else h.kind
            self.hints.labels(name, kind, res.code).inc()

    # ---- from the server -------------------------------------------------------------------------
    def observe_hint_delivery(self, sent_unix_s: float) -> None:
        """Sender's clock to now; skipped when the sender gave no time (0). Skew can make it < 0: clamp."""
        if sent_unix_s > 0:
            self.hint_latency.labels(self.core.model_name).observe(max(0.0, time.time() - sent_unix_s))

    @classmethod
    def of(cls, core: EngineCore) -> EngineMetrics:
        """The metrics already observing ``core``, or new ones: a node never counts an event twice."""
        for o in core.observers:
            if isinstance(o, EngineMetrics):
                return o
        return cls(core)
