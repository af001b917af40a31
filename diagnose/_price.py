"""The bill of a run's pauses under each cache option, the cheapest choice per turn, and the choice the
pause predictor makes online.

The model, per session (one cache line: a session's calls share a growing prefix):

* A request with option ``c`` reads the part of its prompt still cached from the session's previous
  request at the read price and writes the rest at ``c``'s write price; the result is one entry for the
  whole prompt that lives ``ttl(c)`` from the request's start (Anthropic's clock).  Option ``none``
  writes nothing and reads nothing: every token at the base price.  A prompt under the model's minimum is
  not cached at all.  Older entries than the previous request's are ignored (a conservative bill: they
  can only lower it).
* A *renewal* (keep-warm) during a pause: a minimal request on the same prefix (a few tokens in, one out)
  ``RENEW_MARGIN_S`` before the entry lapses reads the prefix and restarts its TTL, where the option's
  reads refresh (``refresh_on_read``).  It is the hosted-API form of the ``hintflow`` policy renewing a
  pin while the conditional pause distribution says it pays.
* Fixed options (``5m``, ``1h``, ...) are what a team gets by setting that TTL on every request and
  nothing else.  ``recommended`` is the cheapest sequence of per-request options and renew-or-lapse
  decisions knowing every pause (a dynamic programme over the previous request's option): the bill to aim
  at, never above the best fixed option.  ``predicted`` decides online with only the past: each request's
  option minimises its expected cost under the ``PauseModel`` (the session's last tool, learned from the
  pauses that had ended by then), and each renewal happens only while E over the remaining pause, given
  the time already elapsed, says renewing is cheaper than letting the entry lapse.
* Output tokens cost the same under every option: they are reported once (``output_usd``), not in the
  options' ``total_usd``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diagnose._prices import CacheOption, ModelPrices
from diagnose._readers import Run
from diagnose._records import TurnRecord, common_prefix
from predictors import PauseDistribution, PauseModel

__all__ = ["RENEW_MARGIN_S", "CostModel", "PriceTurn", "Step", "fixed_bill", "predicted_bill",
           "price_turns", "recommended_bill"]

RENEW_MARGIN_S = 15.0  # a renewal is sent this long before the entry would lapse
PING_INPUT_TOKENS = 8  # a renewal's own new tokens (a one-word user message) ...
PING_OUTPUT_TOKENS = 1  # ... and its reply (max_tokens=1)
UNKNOWN_TOOL = "?"


@dataclass(frozen=True, slots=True)
class PriceTurn:
    """One call as the bill sees it: its prompt, how much of it repeats the previous prompt, and the time
    since the previous request started (that request's latency plus the pause)."""

    program_id: str
    session_id: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    output_tokens: int
    gap_s: float
    tool_before: str | None
    start_s: float


def price_turns(run: Run) -> list[list[PriceTurn]]:
    """The run's sessions as lists of ``PriceTurn``; a session without start times is laid out from its
    pauses (call latency taken as 0), as a replay trace's are."""
    out: list[list[PriceTurn]] = []
    for items in run.sessions().values():
        session: list[PriceTurn] = []
        prev: TurnRecord | None = None
        clock_s = 0.0
        for t in items:
            gap = 0.0 if prev is None else (prev.latency_s or 0.0) + (prev.pause_s or 0.0)
            clock_s = t.start_unix_s if t.start_unix_s is not None else clock_s + gap
            reused = 0
            if prev is not None:
                n = common_prefix(prev.segments, t.segments)
                if t.segments and prev.segments:
                    reused = sum(s.num_tokens for s in t.segments[:n])
                else:  # counts only: assume the previous prompt is a prefix (an upper bound)
                    reused = prev.prompt_tokens
                reused = min(reused, prev.prompt_tokens, t.prompt_tokens)
            session.append(PriceTurn(t.program_id, t.session_id, t.turn, t.prompt_tokens, reused,
                                     t.output_tokens or 0, gap, prev.tool if prev is not None else None, clock_s))
            prev = t
        out.append(session)
    return out


@dataclass(frozen=True, slots=True)
class Step:
    """What a bill did at one call: the option it asked for, the renewals in the pause before it, whether
    the previous entry was read, and what the call (with those renewals) cost."""

    option: str
    renewals: int
    hit: bool
    cost_usd: float


class CostModel:
    """A model's prices and its options' rules, in USD per token."""

    def __init__(self, prices: ModelPrices, options: Sequence[CacheOption]) -> None:
        self.prices = prices
        self.options = {o.name: o for o in options}
        self.read = prices.read_usd_per_mtok / 1e6
        self.output = prices.output_usd_per_mtok / 1e6
        self.write = {o.name: prices.write_usd_per_mtok[o.name] / 1e6 for o in options}
        self.base = prices.input_usd_per_mtok / 1e6
        self.min_tokens = prices.min_cacheable_tokens

    def caches(self, option: str, prompt_tokens: int) -> bool:
        return self.options[option].ttl_s > 0 and prompt_tokens >= max(1, self.min_tokens)

    def call(self, option: str, prompt_tokens: int, hit_tokens: int) -> float:
        """A request's prompt cost: the hit read, the rest written at ``option``'s price."""
        if not self.caches(option, prompt_tokens):
            return self.base * prompt_tokens if self.options[option].ttl_s > 0 else self.write[option] * prompt_tokens
        return self.read * hit_tokens + self.write[option] * (prompt_tokens - hit_tokens)

    def ping(self, option: str, prefix_tokens: int) -> float:
        """One renewal: the prefix read, a few tokens written, one token out."""
        return self.read * prefix_tokens + self.write[option] * PING_INPUT_TOKENS + self.output * PING_OUTPUT_TOKENS

    def period_s(self, option: str) -> float:
        return self.options[option].ttl_s - RENEW_MARGIN_S

    def can_renew(self, option: str) -> bool:
        o = self.options[option]
        return o.refresh_on_read and o.ttl_s > RENEW_MARGIN_S

    def renewals_needed(self, option: str, gap_s: float) -> int | None:
        """Renewals that keep an ``option`` entry alive across ``gap_s`` (0: alive anyway; None: cannot)."""
        ttl = self.options[option].ttl_s
        if gap_s <= ttl:
            return 0
        if not self.can_renew(option):
            return None
        return math.ceil((gap_s - ttl) / self.period_s(option))


def _first_call(costs: CostModel, option: str, t: PriceTurn) -> float:
    return costs.call(option, t.prompt_tokens, 0)


def fixed_bill(costs: CostModel, session: Sequence[PriceTurn], option: str) -> list[Step]:
    """``option`` on every request, no renewals."""
    steps: list[Step] = []
    for i, t in enumerate(session):
        prev = session[i - 1] if i else None
        hit = (prev is not None and costs.caches(option, prev.prompt_tokens)
               and t.gap_s <= costs.options[option].ttl_s and t.reused_tokens > 0)
        steps.append(Step(option, 0, hit, costs.call(option, t.prompt_tokens, t.reused_tokens if hit else 0)))
    return steps


def recommended_bill(costs: CostModel, session: Sequence[PriceTurn], *, renew: bool = True) -> list[Step]:
    """The cheapest per-call options and renew-or-lapse choices, knowing every pause (exact, by dynamic
    programming over the option of the previous request)."""
    names = list(costs.options)
    # state: the previous request's option, or None when it left no entry -> (cost so far, steps)
    best: dict[str | None, tuple[float, list[Step]]] = {None: (0.0, [])}
    for i, t in enumerate(session):
        nxt: dict[str | None, tuple[float, list[Step]]] = {}
        for prev_option, (cost, steps) in best.items():
            carry = None
            if i and prev_option is not None and t.reused_tokens > 0:
                n = costs.renewals_needed(prev_option, t.gap_s)
                if n is not None and (n == 0 or renew):
                    carry = (n, n * costs.ping(prev_option, session[i - 1].prompt_tokens))
            for option in names:
                cold = costs.call(option, t.prompt_tokens, 0)
                step = Step(option, 0, False, cold)
                if carry is not None:
                    warm = carry[1] + costs.call(option, t.prompt_tokens, t.reused_tokens)
                    if warm < cold:
                        step = Step(option, carry[0], True, warm)
                state = option if costs.caches(option, t.prompt_tokens) else None
                total = cost + step.cost_usd
                if state not in nxt or total < nxt[state][0]:
                    nxt[state] = (total, [*steps, step])
        best = nxt
    return min(best.values(), key=lambda v: v[0])[1] if session else []


# ---- online ---------------------------------------------------------------------------------------------
class _RenewalPlan:
    """Whether to renew at the k-th renewal point of a pause, from the pause distribution known when the
    entry was written: renew while the expected cost of carrying on (renew now, then read when the pause
    ends or decide again) is below that of letting the entry lapse and writing it again."""

    def __init__(self, costs: CostModel, option: str, dist: PauseDistribution, prefix_tokens: int) -> None:
        self.values: list[float] = []
        if not costs.can_renew(option) or prefix_tokens <= 0:
            return
        period = costs.period_s(option)
        lapse = costs.write[option]  # per carried token: written again at the next call
        renew = costs.ping(option, prefix_tokens) / prefix_tokens
        support = dist.support()
        horizon = max(1, math.ceil(float(support[-1]) / period) + 1) if len(support) else 1
        # past the data: the remaining pause given the elapsed time, as an exponential with that mean
        tail_q = self._q_tail(dist, horizon * period, period)
        v_next = min(lapse, (renew + tail_q * costs.read) / tail_q) if tail_q > 0 else lapse
        values = [v_next] * (horizon + 1)
        for k in range(horizon, 0, -1):
            elapsed = k * period
            survival = dist.survival(elapsed)
            if survival > 0:
                q = (dist.ecdf(elapsed + period) - dist.ecdf(elapsed)) / survival
            else:
                q = self._q_tail(dist, elapsed, period)
            values[k - 1] = min(lapse, renew + q * costs.read + (1 - q) * v_next)
            v_next = values[k - 1]
        self.values, self.lapse = values, lapse

    @staticmethod
    def _q_tail(dist: PauseDistribution, elapsed_s: float, period_s: float) -> float:
        remaining = dist.conditional_remaining(elapsed_s)
        return 1.0 if remaining <= 0 else -math.expm1(-period_s / remaining)

    def first_value(self) -> float | None:
        return self.values[0] if self.values else None

    def renews(self, k: int) -> bool:
        if not self.values:
            return False
        v = self.values[min(k - 1, len(self.values) - 1)]
        return v < self.lapse - 1e-15


def _expected_carry(costs: CostModel, option: str, dist: PauseDistribution, plan: _RenewalPlan) -> float:
    """Per token of this call's prompt: the expected cost of the next call's reuse of it."""
    if costs.options[option].ttl_s <= 0:
        return min(costs.write.values())  # nothing kept: written again at the next call
    first = plan.first_value()
    if first is None:
        f = dist.ecdf(costs.options[option].ttl_s)
        return f * costs.read + (1 - f) * costs.write[option]
    f = dist.ecdf(costs.period_s(option))
    return f * costs.read + (1 - f) * first


def predicted_bill(costs: CostModel, sessions: Sequence[Sequence[PriceTurn]], model: PauseModel | None = None,
                   *, renew: bool = True) -> list[list[Step]]:
    """Each session's steps when every decision uses only pauses that had ended by then (all sessions'
    calls in time order feed one ``PauseModel``)."""
    model = model if model is not None else PauseModel(min_samples=20)
    order = sorted(((t.start_s, si, i) for si, s in enumerate(sessions) for i, t in enumerate(s)))
    out: list[list[Step]] = [[] for _ in sessions]
    state: list[tuple[str | None, _RenewalPlan | None]] = [(None, None) for _ in sessions]
    for _, si, i in order:
        session, t = sessions[si], sessions[si][i]
        if i:
            model.observe(t.tool_before or UNKNOWN_TOOL, max(0.0, t.gap_s))
        prev_option, plan = state[si]
        renewals, alive = 0, False
        if i and prev_option is not None and t.reused_tokens > 0:
            ttl = costs.options[prev_option].ttl_s
            alive = t.gap_s <= ttl
            if not alive and renew and plan is not None:
                k, period = 1, costs.period_s(prev_option)
                while k * period < t.gap_s and plan.renews(k):
                    renewals += 1
                    if t.gap_s <= k * period + ttl:
                        alive = True
                        break
                    k += 1
        carried = renewals * costs.ping(prev_option, session[i - 1].prompt_tokens) if prev_option else 0.0
        hit = t.reused_tokens if alive else 0
        dist = model.distribution(t.tool_before or UNKNOWN_TOOL)
        best: tuple[float, str, _RenewalPlan] | None = None
        for option in costs.options:
            next_plan = _RenewalPlan(costs, option, dist, t.prompt_tokens) if renew else _RenewalPlan(
                costs, option, dist, 0)
            expected = costs.call(option, t.prompt_tokens, hit) + t.prompt_tokens * _expected_carry(
                costs, option, dist, next_plan)
            if best is None or expected <= best[0]:  # a tie goes to the longer TTL (options: shortest first)
                best = (expected, option, next_plan)
        assert best is not None
        _, option, next_plan = best
        out[si].append(Step(option, renewals, alive, carried + costs.call(option, t.prompt_tokens, hit)))
        state[si] = (option if costs.caches(option, t.prompt_tokens) else None, next_plan)
    return out
