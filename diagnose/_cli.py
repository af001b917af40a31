"""``hintflow diagnose`` and ``hintflow price``: thin commands over ``diagnose_run`` and ``price_run``,
registered on the main group by ``hintflow/cli.py``.

Bad input (a line that cannot be used, an unknown model, a bad price file) is a usage error naming the
file, the line and the field: exit status 2, no traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from diagnose._bill import price_run, render_price
from diagnose._diagnose import Diagnosis, diagnose_run
from diagnose._prices import load_prices
from diagnose._readers import load_run
from diagnose._records import TraceFormatError
from diagnose._report_html import write_html

__all__ = ["diagnose_command", "price_command", "render_diagnosis"]

_STYLE = {"ok": "green", "warn": "yellow", "bad": "red", "n/a": "dim"}


def _out_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's folder must exist and be writable: a usage error now, not after the work."""
    if value is not None:
        parent = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"directory {parent!r} does not exist or is not writable")
    return value


def _load(trace: str) -> Any:
    try:
        return load_run(trace)
    except TraceFormatError as e:
        raise click.UsageError(str(e)) from None


def render_diagnosis(diag: Diagnosis) -> Any:
    from rich.console import Group
    from rich.table import Table

    table = Table(title=f"{diag.source}: {diag.num_programs} programs, {diag.num_sessions} sessions, "
                        f"{diag.num_turns} turns", show_lines=True)
    table.add_column("question", max_width=38)
    table.add_column("status")
    table.add_column("verdict")
    for f in diag.findings:
        table.add_row(f.question, f"[{_STYLE[f.status]}]{f.status}[/]", f.verdict)
    parts: list[Any] = [table]
    breaks = diag.finding("early_blocks").rows
    if breaks:
        bt = Table(title="where the prefix broke (first 15)")
        for col in ("session_id", "turn", "block", "change", "lost_tokens"):
            bt.add_column(col, justify="right" if col in ("turn", "lost_tokens") else "left")
        for r in breaks[:15]:
            bt.add_row(str(r["session_id"])[-30:], str(r["turn"]), r["block"], r["change"], f"{r['lost_tokens']:,}")
        parts.append(bt)
    slow = diag.finding("slow_turns").rows
    if slow:
        st = Table(title="slow turns by factor")
        for col in ("factor", "slow_turns_with_it", "turns_with_it", "lift"):
            st.add_column(col)
        for r in slow:
            st.add_row(*(str(r[c]) for c in ("factor", "slow_turns_with_it", "turns_with_it", "lift")))
        parts.append(st)
    return Group(*parts)


@click.command("diagnose")
@click.argument("trace")
@click.option("--html", "html_out", default=None, callback=_out_file, metavar="OUT.html",
              help="Also write one self-contained HTML report with plots (readable offline).")
@click.option("--json", "json_out", default=None, callback=_out_file, metavar="OUT.json",
              help="Also write the findings and per-turn facts as JSON.")
def diagnose_command(trace: str, html_out: str | None, json_out: str | None) -> None:
    """Answer six questions about an agent loop from TRACE: prefix reuse, reported against possible cache
    hits, changed early blocks, slow turns, hotspots, forced cold prefills.

    TRACE is a recording (HintflowPlugin(record_to=...) or diagnose.record_client), a replay trace or
    generator name (human-in-loop), an OpenTelemetry span export (OTLP JSON lines), or a provider usage
    log (docs/hosted-apis.md)."""
    from rich.console import Console

    diag = diagnose_run(_load(trace))
    Console().print(render_diagnosis(diag))
    if html_out:
        write_html(diag, html_out)
        click.echo(f"wrote {html_out}")
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(diag.to_dict(), f, indent=1)
        click.echo(f"wrote {json_out}")


@click.command("price")
@click.argument("trace")
@click.option("--provider", type=click.Choice(["anthropic", "openai"]), required=True)
@click.option("--model", required=True, help="Model id as the provider names it (claude-opus-5, gpt-5.6-terra, ...).")
@click.option("--prices", "prices_file", default=None, metavar="FILE",
              help="A price file of your own (a copy of diagnose/prices.json).  [default: the bundled one]")
@click.option("--renew/--no-renew", default=True, show_default=True,
              help="Let the per-turn bills keep a cache warm with minimal requests during pauses.")
@click.option("--json", "json_out", default=None, callback=_out_file, metavar="OUT.json",
              help="Write options, recommended and predicted totals and every turn's choices as JSON.")
@click.option("--turns", "max_turns", type=click.IntRange(min=0), default=20, show_default=True,
              help="Turns to show in the terminal table.")
def price_command(trace: str, provider: str, model: str, prices_file: str | None, renew: bool,
                  json_out: str | None, max_turns: int) -> None:
    """Replay TRACE's pauses against each cache option of PROVIDER's MODEL: the bill per option, the
    cheapest choice per turn knowing each pause (recommended), and the pause predictor's online choice
    (predicted)."""
    from rich.console import Console

    try:
        book = load_prices(prices_file)
        result = price_run(_load(trace), book, provider, model, renew=renew)
    except TraceFormatError as e:
        raise click.UsageError(str(e)) from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    Console().print(render_price(result, max_turns))
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        click.echo(f"wrote {json_out}")
