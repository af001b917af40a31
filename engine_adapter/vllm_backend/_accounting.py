"""Per-request prompt-token accounting and latencies on vLLM, as the embedded engine counts them.

The embedded engine (``engine_adapter._metrics``) splits every admitted prompt::

    prompt = device_hit + host_hit + computed
    history (tokens this session computed in an earlier turn) = across_turn_hit + recomputed
    within_turn_hit = hits - across_turn_hit     (e.g. a shared system prompt)

Here the same split is made when vLLM first schedules a request: its hits are vLLM's own
``num_computed_tokens`` at that moment (the prefix-cache lookup, ``NewRequestData.num_computed_tokens``),
and its history is the common prefix of its prompt with the tokens whose KV the session's previous turn
computed (kept on the ``VSession`` when that turn finished). A common prefix rather than the previous
context's length: agent clients often resend their inputs without the model's last output, and those
output tokens are neither history nor recomputed. vLLM folds a KV connector's loads into the same
count; with hintflow's host tier (``_host_connector``) the scheduler passes the tokens it loaded for the
request, which are ``host_hit``; the rest of the hits are ``device_hit``.

The recomputed tokens are told apart by why the context was not there (``lost_by``): ``queued``, what the
device or host tier still held when the turn arrived and lost while it waited; the rest by what became of
the session's pin in the pause before (``engine_adapter._lost_context``: yielded, clamped by the pin budget, ...).
The node's 10 s log line gives their shares (``lost=``): the rule that loses most is the one to tune.

Time to first token and queue wait are measured from the request's ``arrival_time`` (wall time, set by
vLLM's front end) to the step that scheduled it and to the step whose output held its first token, in
the engine core, as the embedded engine measures them in its own.

Nothing here imports vLLM (requests are duck-typed) and nothing is thread-safe: the scheduler calls it
under its ``hint_lock``, and the metrics collector reads it under the same lock.
"""

from __future__ import annotations

import bisect
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine_adapter._lost_context import lost_shares, split_lost

from ._sessions import VSession

__all__ = ["LATENCY_BUCKETS", "Histogram", "RequestAccounting", "common_prefix_len"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)  # fmt: skip
"""The embedded node's TTFT and queue-wait buckets, copied: its module is private (a unit test compares)."""


class Histogram:
    """Prometheus histogram state (per-bucket counts, sum) without a ``prometheus_client`` object.

    Why not ``prometheus_client.Histogram``: under vLLM's ``PROMETHEUS_MULTIPROC_DIR`` those write into
    vLLM's multiprocess directory (``_metrics`` module docstring). Not thread-safe: callers lock.
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of observations <= le)`` pairs, +Inf last, as ``HistogramMetricFamily`` takes them."""
        out, total = [], 0
        for bound, n in zip([*self.buckets, float("inf")], self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out

    def copy(self) -> Histogram:
        h = Histogram(self.buckets)
        h.counts, h.sum = list(self.counts), self.sum
        return h


def common_prefix_len(prompt: array[int], context: array[int]) -> int:
    """Length of the common prefix; slices compare in C, so a binary search beats a Python loop."""
    n = min(len(prompt), len(context))
    if prompt[:n] == context[:n]:
        return n  # the usual case: the prompt extends the context
    lo, hi = 0, n  # prompt[:lo] matches, prompt[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prompt[:mid] == context[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _tokens(ids: Sequence[int] | None) -> array[int]:
    return array("q", ids or ())  # 8 bytes a token, not a Python int object each


@dataclass
class RequestAccounting:
    """Counters and histograms of the ``hintflow_*`` per-request series; see the module docstring."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    computed_tokens: int = 0
    across_turn_prompt_tokens: int = 0
    across_turn_hit_tokens: int = 0
    within_turn_hit_tokens: int = 0
    recomputed_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_wait: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    lost_by: dict[str, int] = field(default_factory=dict)  # recomputed tokens by cause (module docstring)
    wall_clock: Callable[[], float] = time.time  # requests' arrival_time is wall time
    _scheduled: set[str] = field(default_factory=set)  # request ids accounted (first scheduling seen)
    _first_token: dict[str, Any] = field(default_factory=dict)  # request id -> request without output yet

    def on_scheduled(
        self, request: Any, hit_tokens: int, session: VSession | None, host_hit_tokens: int = 0,
        arrival: tuple[str, int] | None = None,
    ) -> int | None:
        """vLLM scheduled ``request`` as a new one, with ``hit_tokens`` found cached (``host_hit_tokens``
        of them loaded from the host tier); returns the tokens of its prompt the session's last turn had
        (its history), or None when it was counted before. ``arrival``: the session's ``pause_fate`` and
        the prompt tokens found cached when the request arrived (None: not known, all lost to the fate
        ``unpinned``).

        Only the first time counts: vLLM's V2 model runner lists resumed (preempted) requests as new too.
        """
        if request.request_id in self._scheduled:
            return None
        self._scheduled.add(request.request_id)
        prompt = request.num_prompt_tokens
        host_hit_tokens = min(max(0, host_hit_tokens), hit_tokens)
        self.host_hit_tokens += host_hit_tokens
        self.device_hit_tokens += hit_tokens - host_hit_tokens
        self.computed_tokens += max(0, prompt - hit_tokens)
        history = 0
        if session is not None and session.context:
            history = common_prefix_len(_tokens(request.prompt_token_ids), session.context)
        across_hit = min(hit_tokens, history)
        self.across_turn_prompt_tokens += history
        self.across_turn_hit_tokens += across_hit
        self.within_turn_hit_tokens += hit_tokens - across_hit
        self.recomputed_tokens += history - across_hit
        fate, cached_then = arrival if arrival is not None else ("unpinned", 0)
        for cause, n in split_lost(history, hit_tokens, fate, cached_then):
            self.lost_by[cause] = self.lost_by.get(cause, 0) + n
        self.queue_wait.observe(max(0.0, self.wall_clock() - request.arrival_time))
        self._first_token[request.request_id] = request
        return history

    def snapshot(self) -> RequestAccounting:
        """The counters and histograms as they are now (a scrape takes it under the scheduler's lock)."""
        return replace(
            self, ttft=self.ttft.copy(), queue_wait=self.queue_wait.copy(), lost_by=dict(self.lost_by),
            _scheduled=set(), _first_token={},
        )

    def lost_shares(self) -> str:
        """The log line's ``lost=`` (``_lost_context.lost_shares``)."""
        return lost_shares(self.lost_by)

    def after_step(self) -> None:
        """A step's output was applied: requests that now have an output token had their first one."""
        for rid, req in list(self._first_token.items()):
            if req.num_output_tokens > 0 or req.is_finished():
                self._first_token_seen(rid)

    def on_finished(self, request: Any, session: VSession | None) -> None:
        """The request's blocks are freed (inside the step's output, before ``after_step``): a one-token
        request gets its TTFT here, and its computed tokens become its session's history."""
        self._first_token_seen(request.request_id)
        self._scheduled.discard(request.request_id)
        if session is not None and request.num_computed_tokens > 0:
            session.context = _tokens(request.all_token_ids[: request.num_computed_tokens])

    def _first_token_seen(self, request_id: str) -> None:
        req = self._first_token.pop(request_id, None)
        if req is not None and req.num_output_tokens > 0:  # none: aborted first, no TTFT (as on our node)
            self.ttft.observe(max(0.0, self.wall_clock() - req.arrival_time))
