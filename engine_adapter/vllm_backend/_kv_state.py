"""A stock vLLM node's ``CacheState``: residency from its KV events, the rest from vLLM's own ``/metrics``.

:class:`VllmCacheStateSource` adds what events cannot tell (queue lengths, usage, pool size, model name)
from vLLM's ``/metrics`` to the residency a :class:`KvEventSubscriber` folds, and yields a ``CacheState``
with a version that moves with either. The prefill backlog is an estimate (waiting requests x mean
uncached prompt): stock vLLM exports no backlog.

Separate from ``_kv_sidecar`` (which serves this state over gRPC and Prometheus) because this is what the
state *is* for a node without hintflow's scheduler, the counterpart of ``_cache_state.cache_state``.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hints import CacheState

from ._kv_events import GPU
from ._kv_subscriber import KvEventSubscriber

__all__ = ["VllmCacheStateSource"]

log = logging.getLogger(__name__)


def _scrape(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """The few ``vllm:*`` values a CacheState needs, from vLLM's Prometheus text."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, Any] = {}
    sums: dict[str, float] = {}
    usage: list[float] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("vllm:"):
                continue
            if "model_name" in s.labels:
                out.setdefault("model_name", s.labels["model_name"])
            if s.name == "vllm:cache_config_info":
                out["num_gpu_blocks"] = int(float(s.labels.get("num_gpu_blocks") or 0))
                out["block_size"] = int(float(s.labels.get("block_size") or 0))
            elif s.name == "vllm:kv_cache_usage_perc":
                usage.append(s.value)  # per engine: several (data parallel) share the pool size
            elif s.name in (
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:request_prompt_tokens_sum",
                "vllm:request_prompt_tokens_count",
                "vllm:prompt_tokens_cached_total",
            ):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    out.update(sums)
    if usage:
        out["vllm:kv_cache_usage_perc"] = sum(usage) / len(usage)
    return out


class VllmCacheStateSource:
    """A stock vLLM node's ``CacheState``: residency from KV events, the rest from vLLM's ``/metrics``.

    ``metrics_url`` None: events only (no queue lengths; usage from resident blocks over ``total_blocks``).
    Scrapes at most every ``scrape_period_s``; a failed scrape keeps the last values.
    """

    def __init__(
        self,
        subscriber: KvEventSubscriber,
        metrics_url: str | None,
        *,
        node_id: str = "vllm",
        model_name: str = "",
        total_blocks: int = 0,
        scrape_period_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.subscriber = subscriber
        self.metrics_url = metrics_url
        self.node_id = node_id
        self.model_name = model_name
        self.total_blocks = total_blocks
        self.scrape_period_s = scrape_period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._metrics: dict[str, Any] = {}
        self._scraped_at = -float("inf")
        self._metrics_changes = 0

    def _refresh(self) -> dict[str, Any]:
        with self._lock:
            if self.metrics_url and self.clock() - self._scraped_at >= self.scrape_period_s:
                self._scraped_at = self.clock()
                try:
                    new = _scrape(self.metrics_url)
                except Exception as e:  # the node is down or slow: keep the last view, the router ages it
                    log.info("hintflow: scraping %s failed: %s", self.metrics_url, e)
                else:
                    if new != self._metrics:
                        self._metrics = new
                        self._metrics_changes += 1
            return self._metrics

    def version(self) -> int:
        self._refresh()
        with self.subscriber.lock:
            return self.subscriber.residency.version + self._metrics_changes

    def state(self, include_sessions: bool) -> CacheState:
        m = self._refresh()
        with self.subscriber.lock:
            res = self.subscriber.residency
            version = res.version + self._metrics_changes
            bs = res.block_size or int(m.get("block_size", 0))
            sessions = res.residencies() if include_sessions else []
            resident = res.num_resident(GPU)
        total = self.total_blocks or max(0, int(m.get("num_gpu_blocks", 0)) - 1)  # less vLLM's null block
        usage = m.get("vllm:kv_cache_usage_perc")
        if usage is None:  # events only: cached blocks are "used" by this measure (an upper bound)
            usage = resident / total if total else 0.0
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        count = m.get("vllm:request_prompt_tokens_count", 0.0)
        uncached = 0.0
        if count:
            uncached = (
                m.get("vllm:request_prompt_tokens_sum", 0.0) - m.get("vllm:prompt_tokens_cached_total", 0.0)
            ) / count
        return CacheState(
            node_id=self.node_id,
            model_name=self.model_name or str(m.get("model_name", "")),
            block_size=bs,
            total_blocks=total,
            free_blocks=max(0, min(total, round(total * (1.0 - float(usage))))),
            pinned_blocks=0,
            host_total_blocks=0,
            host_free_blocks=0,
            num_waiting=waiting,
            num_running=int(m.get("vllm:num_requests_running", 0)),
            prefill_backlog_tokens=max(0, round(waiting * uncached)),
            sessions=sessions,
            node_time_s=self.clock(),
            version=version,
        )
