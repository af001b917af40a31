"""Live advice for a harness: which cache option to ask for on the next request, and whether to renew a
cache during a pause, from the pauses seen so far (the same rule as ``hintflow price``'s predicted bill).

    advisor = TTLAdvisor("anthropic", "claude-opus-5")
    option = advisor.choose(prompt_tokens=42_000, hit_tokens=40_000, tool="human")   # -> CacheOption "1h"?
    ...
    advisor.observe("human", pause_s=610.0)      # when the person answered
"""

from __future__ import annotations

import os

from diagnose._price import UNKNOWN_TOOL, CostModel, _expected_carry, _RenewalPlan
from diagnose._prices import CacheOption, load_prices
from predictors import PauseModel

__all__ = ["TTLAdvisor"]


class TTLAdvisor:
    """The pause predictor and a model's cache prices, asked one request (or one renewal) at a time."""

    def __init__(self, provider: str, model: str, *, prices: str | os.PathLike[str] | None = None,
                 pause_model: PauseModel | None = None, renew: bool = True) -> None:
        book = load_prices(prices)
        model_prices = book.model(provider, model)
        options, _ = book.options_for(model_prices)
        if not options:
            raise ValueError(f"{provider} model {model_prices.model} has no available cache option")
        self.costs = CostModel(model_prices, options)
        self.pause_model = pause_model if pause_model is not None else PauseModel(min_samples=20)
        self.renew = renew

    def observe(self, tool: str | None, pause_s: float) -> None:
        """A pause ended: ``tool`` (or a person) held the session for ``pause_s``."""
        self.pause_model.observe(tool or UNKNOWN_TOOL, max(0.0, float(pause_s)))

    def choose(self, prompt_tokens: int, hit_tokens: int = 0, tool: str | None = None,
               *, allow_none: bool = False) -> CacheOption:
        """The option whose expected cost (this request, plus carrying its prompt across the pause that
        follows, as ``tool``'s pauses have gone so far) is least.  ``none`` only when ``allow_none``:
        a harness usually does not know that a turn is its last."""
        dist = self.pause_model.distribution(tool or UNKNOWN_TOOL)
        best: tuple[float, str] | None = None
        for name, option in self.costs.options.items():
            if option.ttl_s <= 0 and not allow_none:
                continue
            plan = _RenewalPlan(self.costs, name, dist, prompt_tokens if self.renew else 0)
            expected = (self.costs.call(name, prompt_tokens, hit_tokens)
                        + prompt_tokens * _expected_carry(self.costs, name, dist, plan))
            if best is None or expected <= best[0]:  # a tie goes to the longer TTL
                best = (expected, name)
        if best is None:
            raise ValueError("no caching option to choose from")
        return self.costs.options[best[1]]

    def should_renew(self, option: str, prefix_tokens: int, elapsed_s: float, tool: str | None = None) -> bool:
        """At ``elapsed_s`` into a pause (a renewal point, ``RENEW_MARGIN_S`` before the entry lapses):
        whether a keep-warm request is expected to cost less than letting the entry lapse."""
        if not self.renew or not self.costs.can_renew(option):
            return False
        plan = _RenewalPlan(self.costs, option, self.pause_model.distribution(tool or UNKNOWN_TOOL), prefix_tokens)
        k = max(1, round(elapsed_s / self.costs.period_s(option)))
        return plan.renews(k)
