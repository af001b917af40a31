"""``hintflow price``'s result: every option's bill, the recommended and predicted bills, per turn.

The JSON (``--json OUT``) is the contract: ``options`` (one per priced option, named by its TTL, each
with ``total_usd``), ``recommended_total_usd``, ``predicted_total_usd`` and ``turns`` (per call: prompt,
reuse, the pause before it, each bill's choice and cost), plus what the terminal table shows.
"""

from __future__ import annotations

from typing import Any

from diagnose._price import CostModel, Step, fixed_bill, predicted_bill, price_turns, recommended_bill
from diagnose._prices import PriceBook
from diagnose._readers import Run
from predictors import PauseModel

__all__ = ["price_run", "render_price"]


def _total(steps: list[list[Step]]) -> float:
    return sum(s.cost_usd for session in steps for s in session)


def price_run(run: Run, book: PriceBook, provider: str, model: str, *, renew: bool = True,
              pause_model: PauseModel | None = None) -> dict[str, Any]:
    """Price ``run`` for ``provider``/``model`` under the price file ``book`` (see ``_price``)."""
    prices = book.model(provider, model)
    options, unavailable = book.options_for(prices)
    if not options:
        raise ValueError(f"{book.path}: {provider} model {prices.model} offers no available cache option")
    costs = CostModel(prices, options)
    sessions = [s for s in price_turns(run) if s]
    fixed = {o.name: [fixed_bill(costs, s, o.name) for s in sessions] for o in options}
    recommended = [recommended_bill(costs, s, renew=renew) for s in sessions]
    predicted = predicted_bill(costs, sessions, pause_model, renew=renew)
    totals = {name: _total(steps) for name, steps in fixed.items()}
    best_fixed = min(totals, key=lambda n: totals[n])
    output_usd = sum(t.output_tokens for s in sessions for t in s) * costs.output
    turns: list[dict[str, Any]] = []
    for si, session in enumerate(sessions):
        for i, t in enumerate(session):
            rec, pred = recommended[si][i], predicted[si][i]
            turns.append({
                "program_id": t.program_id, "session_id": t.session_id, "turn": t.turn,
                "prompt_tokens": t.prompt_tokens, "reused_tokens": t.reused_tokens,
                "gap_before_s": round(t.gap_s, 3), "tool_before": t.tool_before,
                "pause_after_s": round(session[i + 1].gap_s, 3) if i + 1 < len(session) else None,
                "options_usd": {name: round(fixed[name][si][i].cost_usd, 6) for name in fixed},
                "recommended": {"option": rec.option, "renewals_before": rec.renewals, "read": rec.hit,
                                "cost_usd": round(rec.cost_usd, 6)},
                "predicted": {"option": pred.option, "renewals_before": pred.renewals, "read": pred.hit,
                              "cost_usd": round(pred.cost_usd, 6)},
            })
    return {
        "provider": provider, "model": prices.model, "model_asked": model,
        "prices_file": book.path, "prices_checked": book.checked, "prices_source": prices.source,
        "prices_verified": prices.verified, "renewals": renew,
        "num_sessions": len(sessions), "num_turns": sum(len(s) for s in sessions),
        "options": {o.name: {"total_usd": round(totals[o.name], 6), "ttl_s": o.ttl_s, "request": o.request,
                             "note": o.note} for o in options},
        "unavailable_options": {o.name: o.note for o in unavailable},
        "best_fixed_option": best_fixed, "best_fixed_total_usd": round(totals[best_fixed], 6),
        "recommended_total_usd": round(_total(recommended), 6),
        "predicted_total_usd": round(_total(predicted), 6),
        "output_usd": round(output_usd, 6),
        "turns": turns,
    }


def render_price(result: dict[str, Any], max_turns: int = 20) -> Any:
    """The result as rich renderables: the bill per option, then the first turns' choices."""
    from rich.console import Group
    from rich.table import Table

    bills = Table(title=f"prompt-side bill, {result['provider']} {result['model']} (prices checked "
                        f"{result['prices_checked']}; output ${result['output_usd']:.4f} under any option)")
    bills.add_column("option")
    bills.add_column("TTL", justify="right")
    bills.add_column("total USD", justify="right")
    bills.add_column("vs best fixed", justify="right")
    best = result["best_fixed_total_usd"] or 1e-12
    for name, o in result["options"].items():
        bills.add_row(name, f"{o['ttl_s']:g} s", f"{o['total_usd']:.4f}", f"{o['total_usd'] / best - 1:+.1%}")
    renew = " with renewals" if result["renewals"] else ""
    bills.add_row("recommended", "per turn" + renew, f"{result['recommended_total_usd']:.4f}",
                  f"{result['recommended_total_usd'] / best - 1:+.1%}", style="bold green")
    bills.add_row("predicted", "online" + renew, f"{result['predicted_total_usd']:.4f}",
                  f"{result['predicted_total_usd'] / best - 1:+.1%}", style="bold")
    for name, note in result["unavailable_options"].items():
        bills.add_row(name, "not priced", "-", "-", style="dim")
        bills.caption = f"{name}: {note}"
    turns = Table(title=f"per turn (first {min(max_turns, len(result['turns']))} of {len(result['turns'])})",
                  caption="option +Nr: N keep-warm renewals during the pause before this turn")
    for col in ("session", "turn", "prompt", "reused", "gap s", "recommended", "USD", "predicted", "USD "):
        turns.add_column(col, justify="right" if col not in ("session", "recommended", "predicted") else "left")
    for t in result["turns"][:max_turns]:
        def label(c: dict[str, Any]) -> str:
            return c["option"] + (f" +{c['renewals_before']}r" if c["renewals_before"] else "")
        session = t["session_id"]
        if not session.startswith(t["program_id"]):
            session = f"{t['program_id']}/{session}"
        turns.add_row(session[-24:], str(t["turn"]), str(t["prompt_tokens"]), str(t["reused_tokens"]),
                      f"{t['gap_before_s']:.0f}", label(t["recommended"]), f"{t['recommended']['cost_usd']:.4f}",
                      label(t["predicted"]), f"{t['predicted']['cost_usd']:.4f}")
    return Group(bills, turns) if max_turns else bills
