"""Continuum's pin TTL: how long keeping a context resident through a tool pause pays for itself.

At a turn end whose next step is tool f, Continuum (arXiv 2511.02230) pins the context for::

    tau* = argmax over tau in {0} ∪ S[f] of  ECDF_f(tau) * B - tau,    B = T * eta + PrefillReload(ctx)

Per unit of memory held, a pin of length tau costs tau seconds of memory-time and, with probability
ECDF_f(tau) (the tool returns before the pin expires), saves B seconds: the re-prefill of the context
plus the queueing delay an evicted request suffers (T, discounted by eta, how strongly the turns a
program has had predict that fewer remain).  Only the observed durations S[f] (and 0, "do not pin")
can be optima, since the ECDF is flat between them.

Closed form for the cold-start default, Exp(1) tools (times in units of the mean tool time):
d/dtau [(1 - e^-tau) B - tau] = B e^-tau - 1 = 0 gives tau = ln B when B > 1, else 0 (the value is
then decreasing from tau = 0).  For Exp(mean m) it is m ln(B / m).

Renewal (:meth:`ContinuumTTL.ttl_remaining`): when a pin expires and the tool is still running, the
same rule on the conditional distribution of T - t given T > t decides whether to pin again and for how
long.  Under a heavy tail the conditional distribution spreads out as t grows (and, past the last
sample, its extrapolated mean excess grows with t), so the chance of a return within any tau falls
until no tau pays: a stuck tool cannot hold memory forever.  Except under the cold-start default: the
exponential is memoryless, so every renewal would decide the same tau and a stuck tool would keep its
pin for as long as it runs.  The default is a prior, not evidence about this pause, so pins decided on
it are renewed only while the pause is within the prior's own range (its 99th percentile, 4.6 mean
pause times): a pause longer than that is not one the prior describes.

Memory share (``pool_tokens``, hintflow's rule; without it, Continuum's): Continuum charges a pin ``tau``
whatever it holds, as if every pinned context held the whole pool.  What a pin takes from the other turns
is its share of the device pool for ``tau``: a context of ``c`` tokens on a pool of ``M`` costs
``tau * c / M`` pool-seconds.  So with the pool known the benefit is scaled by ``M / c`` (at least 1):
a context a sixth of the pool is worth pinning six times as long.  It pays where re-prefill is most of
the engine's work: on a real vLLM node running the agent benchmark (contexts about a sixth of the pool,
no host tier) mean JCT fell 84 -> 72 s, and in the replay of that trace 35.4 -> 30.1 s.  Where decoding
dominates it does not: on the replay's multi-agent workload (a fifth of step time is prefill) it cost
13% mean JCT, so the vLLM node's inference uses it and the orchestrator's policy only when asked
(``memory_share``; docs/benchmarks.md).

eta = -Corr(k, N - k) over the (k, N - k) pairs of finished programs (k = 1..N turns served, N total).
We clamp it to [0, 1]: a negative value would turn queueing delay into a reason not to pin, which the
cost model does not support; until ``min_programs`` programs (with non-degenerate variance) have
finished, eta = 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from predictors._lost_wait import LostContextWait
from predictors._pause_model import PauseDistribution, PauseModel

__all__ = ["ContinuumTTL", "HostTierTTL", "continuum_tau"]


def continuum_tau(dist: PauseDistribution, benefit_s: float) -> float:
    """argmax over tau in {0} ∪ support(dist) of ECDF(tau) * benefit_s - tau; ties go to the shorter pin."""
    if not math.isfinite(benefit_s):
        raise ValueError(f"benefit_s must be finite, got {benefit_s}")
    taus = dist.support()
    values = dist.ecdf_array(taus) * benefit_s - taus
    best = int(np.argmax(values)) if taus.size else -1
    if best < 0 or values[best] <= dist.ecdf(0.0) * benefit_s:
        return 0.0
    return float(taus[best])


MAX_PREFILL_SHARE = 0.95
"""The measured price reads a prefill share at most this (p / (1 - p) at most 19): a node that only
prefilled lately would otherwise price a pin as worth any memory."""

DEFAULT_RENEW_QUANTILE = 0.99
"""Under the cold-start default, pins are renewed only while the pause is shorter than this quantile."""


class ContinuumTTL:
    """Continuum's TTL rule with its online estimators of T (queueing delay) and eta (turn correlation)."""

    def __init__(
        self,
        pause_model: PauseModel,
        prefill_reload: Callable[[int], float],
        *,
        queue_window: int = 100,
        min_programs: int = 10,
        pool_tokens: Callable[[], float] | None = None,
        queue_delay_floor_s: Callable[[], float] | None = None,
        count_queue_delay: bool = True,
        prefill_share: Callable[[], float] | None = None,
        unpinned_survival: Callable[[], float] | None = None,
    ) -> None:
        """``prefill_reload(context_tokens)`` is the seconds to re-prefill a context of that length
        (Continuum uses a profiled quadratic fit).  ``pool_tokens()``: the device pool a pin holds memory
        of, in tokens, read at each decision (0 or None: not known, Continuum's cost).
        ``queue_delay_floor_s()``: a floor under T, read at each decision (the vLLM node's inference
        gives the wait behind the engine's prefill backlog: Continuum's T is 0 until evicted turns have
        been seen queueing, so under a sudden load no pin would pay exactly when pins matter most).
        ``count_queue_delay=False``: B is the re-prefill alone (T left out, as :class:`HostTierTTL` leaves
        it out: on nodes where device memory is what every turn queues for, the wait a pin saves its own
        program it adds to the turns queued behind the memory it holds).
        ``prefill_share()`` (and ``unpinned_survival()``): the measured price instead of T (see
        :meth:`benefit_s`), from the node's :class:`PrefillShare` and :class:`UnpinnedSurvival`."""
        if queue_window < 1:
            raise ValueError(f"queue_window must be >= 1, got {queue_window}")
        self.pause_model = pause_model
        self.prefill_reload = prefill_reload
        self.pool_tokens = pool_tokens
        self.queue_delay_floor_s = queue_delay_floor_s
        self.count_queue_delay = count_queue_delay
        self.prefill_share = prefill_share
        self.unpinned_survival = unpinned_survival
        self.min_programs = min_programs
        self._queue_delays = LostContextWait(queue_window)
        # Exact integer moments of the (k, r = N - k) pairs; Python ints never lose precision.
        self._num_programs = 0
        self._n = self._sk = self._sr = self._skk = self._srr = self._skr = 0

    def learn_from(self, other: ContinuumTTL) -> None:
        """Take over what ``other`` has measured (T's window, eta's moments): a policy that switches rule
        (its nodes gained a host tier) keeps its estimates rather than starting cold."""
        self._queue_delays = other._queue_delays.copy()
        self._num_programs = other._num_programs
        self._n, self._sk, self._sr = other._n, other._sk, other._sr
        self._skk, self._srr, self._skr = other._skk, other._srr, other._skr

    # ---- T: sliding mean queueing delay of requests whose context had been evicted ---------------------
    def observe_evicted_queue_delay(self, delay_s: float) -> None:
        self._queue_delays.observe(delay_s)

    @property
    def queue_delay_s(self) -> float:
        """T: 0 until any evicted request has been observed (Continuum's start), at least the floor; 0
        when not counted."""
        if not self.count_queue_delay:
            return 0.0
        t = self._queue_delays.mean_s
        return max(t, self.queue_delay_floor_s()) if self.queue_delay_floor_s is not None else t

    # ---- eta: -Corr(k, N - k) over finished programs -------------------------------------------------
    def observe_program_finished(self, num_turns: int) -> None:
        """Add the pairs (k, N - k) for k = 1..N of a finished program with N = ``num_turns`` turns."""
        if num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {num_turns}")
        n = num_turns
        sum_k = n * (n + 1) // 2
        sum_kk = n * (n + 1) * (2 * n + 1) // 6
        self._num_programs += 1
        self._n += n
        self._sk += sum_k
        self._sr += n * n - sum_k  # sum of (N - k)
        self._skk += sum_kk
        self._srr += n * n * n - 2 * n * sum_k + sum_kk  # sum of (N - k)^2
        self._skr += n * sum_k - sum_kk  # sum of k (N - k)

    @property
    def eta(self) -> float:
        """-Corr(k, N - k) clamped to [0, 1]; 1 until ``min_programs`` programs give a defined value."""
        if self._num_programs < self.min_programs:
            return 1.0
        n = self._n
        var_k = n * self._skk - self._sk * self._sk
        var_r = n * self._srr - self._sr * self._sr
        if var_k <= 0 or var_r <= 0:
            return 1.0
        corr = (n * self._skr - self._sk * self._sr) / math.sqrt(var_k * var_r)
        return min(max(-corr, 0.0), 1.0)

    # ---- the rule ------------------------------------------------------------------------------------
    def benefit_s(self, context_tokens: int) -> float:
        """B = T * eta + PrefillReload(ctx): seconds a pin saves if the tool returns in time; with the pool
        known, per pool-second held (times ``memory_scale``).  With ``prefill_share`` the measured price
        instead: ``PrefillReload(ctx) * (1 - s) * max(1, p / (1 - p)) * M / c``, where ``s`` is the share
        of an unpinned context still on the device at its return (the pin saves the rest only), and ``p``
        the prefill share of the node's step time.  T is left out: the wait a pin saves its own program
        it gives to the turns queued behind the memory it holds.  What the memory buys is decode
        batching, ``1 - p`` of the engine's time, what the pin saves is prefill, ``p`` of it; where
        prefill is most of the work (``p / (1 - p)`` above 1) the re-prefill weighs that much more, where
        decode is, the price is the memory-share price (never less: a pin that returns still saves its
        re-prefill)."""
        reload_s = float(self.prefill_reload(context_tokens))
        measured = self.measured_weights()
        if measured is not None:
            lost, weight = measured
            b = reload_s * lost * weight
        else:
            b = self.queue_delay_s * self.eta + reload_s
        return b * self.memory_scale(context_tokens)

    def measured_weights(self) -> tuple[float, float] | None:
        """The measured price's two factors from the node's readings, ``(1 - s, max(1, p / (1 - p)))``
        (a reading that is not a finite number counts as 0); None without ``prefill_share``."""
        if self.prefill_share is None:
            return None
        p = float(self.prefill_share())
        p = min(max(p, 0.0), MAX_PREFILL_SHARE) if math.isfinite(p) else 0.0
        s = float(self.unpinned_survival()) if self.unpinned_survival is not None else 0.0
        s = min(max(s, 0.0), 1.0) if math.isfinite(s) else 0.0
        return 1.0 - s, max(1.0, p / (1.0 - p))

    def memory_scale(self, context_tokens: int) -> float:
        """M / c, at least 1, for a context of c tokens on a pool of M (1 when the pool is not known)."""
        pool = float(self.pool_tokens()) if self.pool_tokens is not None else 0.0
        if not (pool > 0.0 and math.isfinite(pool)) or context_tokens <= 0:
            return 1.0
        return max(1.0, pool / context_tokens)

    def ttl(self, tool: str, context_tokens: int) -> float:
        """tau* in seconds for a pause of ``tool`` that starts now (0 = do not pin)."""
        return continuum_tau(self.pause_model.distribution(tool), self.benefit_s(context_tokens))

    def ttl_remaining(self, tool: str, elapsed_s: float, context_tokens: int) -> float:
        """tau* for a further pin, decided on T - t given T > t after ``elapsed_s`` of pause (0 once the
        pause has outlasted the cold-start default's 99th percentile: see the module docstring)."""
        base = self.pause_model.distribution(tool)
        if self.pause_model.source(tool) == "default" and elapsed_s >= base.quantile(DEFAULT_RENEW_QUANTILE):
            return 0.0
        dist = base.conditional(elapsed_s)
        return continuum_tau(dist, self.benefit_s(context_tokens))


class HostTierTTL(ContinuumTTL):
    """Continuum's pin rule on a node with a host tier: the benefit of a pin is the reload it saves, T = 0.

    Continuum adds T, the queueing delay of turns whose context was evicted, because such a turn goes back
    through the prefill queue.  With a host tier an unpinned context is copied out, not lost, and what a
    pin still saves in queueing it takes from the other turns when device memory is what they all queue
    for.  T is also measured on the few turns that did recompute, which under memory pressure are those
    that queued longest, and longer pins make that queue longer: on ``hintflow replay -w multi-agent
    --seed 1`` the loop reached 5.1 M pinned token-seconds and 94.4 s mean JCT, against 50.1 s with T
    left out (swe-agent seeds 0-3, where pins never paid anyway: unchanged). The orchestrator's hintflow
    policy and the vLLM node's engine-side inference both use it where the node has a host tier.

    A host tier too small for the contexts it is given does not bring them back: they are overwritten
    before their turn returns.  With ``host_hit_fraction()`` (the share of an evicted context's tokens that
    did come back from the host, as the node measures it) and ``miss_reload`` (the re-prefill), a lost
    context is priced as what happens to it: ``h * reload + (1 - h) * (T * eta + miss_reload)``, so a host
    that keeps nothing prices pins as no host would.  Without them, ``h = 1``: every context comes back.
    The lost share keeps T even where the node's readings give a measured price (``prefill_share``, which a
    node without a tier prices by, :meth:`ContinuumTTL.benefit_s`): on the real vLLM node with a short host
    tier, trace B, three paired rounds, the pushed policy took 0.72x the stock scheduler's mean JCT with T
    there and 1.03x with the measured price (across-turn hits 54% against 20%), and the replay fitted to
    that node predicted the same (0.72x against 0.98x); the node's own inference keeps T there too.  In the
    replay's generators the measured price traded multi-agent's 52.00 -> 47.80 s mean JCT for swe-agent's
    20.08 -> 20.65 s (docs/benchmarks.md, "The measured pin price").
    """

    def __init__(
        self,
        pause_model: PauseModel,
        prefill_reload: Callable[[int], float],
        *,
        miss_reload: Callable[[int], float] | None = None,
        host_hit_fraction: Callable[[], float] | None = None,
        **kw: Any,
    ) -> None:
        if kw.get("prefill_share") is not None:
            raise ValueError("HostTierTTL prices the share of a context its tier does not give back by T, not "
                             "by the measured price: prefill_share is ContinuumTTL's (a node without a tier)")
        super().__init__(pause_model, prefill_reload, **kw)
        self.miss_reload = miss_reload
        self.host_hit_fraction = host_hit_fraction

    @property
    def queue_delay_s(self) -> float:
        return 0.0

    def miss_queue_delay_s(self) -> float:
        """T for the part that recomputes: Continuum's measured mean, at least the floor."""
        return ContinuumTTL.queue_delay_s.fget(self)  # type: ignore[attr-defined,no-any-return]

    def benefit_s(self, context_tokens: int) -> float:
        h = 1.0
        if self.miss_reload is not None and self.host_hit_fraction is not None:
            h = min(1.0, max(0.0, float(self.host_hit_fraction())))
            if not math.isfinite(h):
                h = 1.0
        b = h * float(self.prefill_reload(context_tokens))
        if h < 1.0 and self.miss_reload is not None:
            b += (1.0 - h) * (self.miss_queue_delay_s() * self.eta + float(self.miss_reload(context_tokens)))
        return b * self.memory_scale(context_tokens)
