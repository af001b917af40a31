"""One self-contained HTML file: the six verdicts and four plots as inline SVG (no scripts, no fonts, no
network), readable offline in any browser.

Plots: prefix reuse per turn (repeated and reported-cached fractions), the pause distribution per tool
(ECDF, log time), TTFT (or latency) against the pause before the turn and against prefix reuse, and the
load per node.  A plot the source has no data for says so in its place.
"""

from __future__ import annotations

import html
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from diagnose._diagnose import Diagnosis

__all__ = ["render_html", "write_html"]

_STATUS_COLOR = {"ok": "#1a7f37", "warn": "#9a6700", "bad": "#cf222e", "n/a": "#57606a"}
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;max-width:1100px;color:#1f2328}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px} .meta{color:#57606a;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border:1px solid #d0d7de;padding:4px 8px;
text-align:left;vertical-align:top} th{background:#f6f8fa} .status{font-weight:600;text-transform:uppercase}
figure{margin:8px 0 20px} figcaption{font-size:13px;color:#57606a} .nodata{border:1px dashed #d0d7de;
padding:24px;color:#57606a;font-size:13px} svg{max-width:100%;height:auto}
"""


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: the SVG sits inside HTML


def _figure(plot: Any, diag: Diagnosis, caption: str, *, ncols: int = 1,
            figsize: tuple[float, float] = (10, 3.6)) -> str:
    """One plot as inline SVG, or a note in its place when ``plot`` says the source has no data for it."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend needed

    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, ncols, squeeze=False)
    try:
        empty = plot(axes[0], diag)
        if empty:
            return (f'<figure><div class="nodata">{html.escape(empty)}</div>'
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>")
        fig.tight_layout()
        return f"<figure>{_svg(fig)}<figcaption>{html.escape(caption)}</figcaption></figure>"
    finally:
        fig.clear()


def _plot_reuse(axes: Any, diag: Diagnosis) -> str:
    ax = axes[0]
    later = [f for f in diag.facts if f.index > 0]
    if not later:
        return "no session has a second turn: no prefix to repeat"
    sessions: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for f in diag.facts:
        sessions[f.rec.key].append(f)
    for i, items in enumerate(sessions.values()):
        items.sort(key=lambda f: f.index)
        xs = [f.rec.turn for f in items]
        ax.plot(xs, [f.reuse_fraction for f in items], color="C0", alpha=0.6, lw=1.2, marker="o", ms=3,
                label="repeated from the previous turn" if i == 0 else None)
        cached = [(f.rec.turn, f.cached_fraction) for f in items if f.cached_fraction is not None]
        if cached:
            ax.plot([c[0] for c in cached], [c[1] for c in cached], color="C1", alpha=0.6, lw=1, ls="--",
                    marker="x", ms=4, label="reported cached" if i == 0 else None)
    for f in diag.facts:
        if f.brk is not None and f.brk.early:
            ax.axvline(f.rec.turn, color="C3", alpha=0.5, lw=1)
            ax.annotate(f.brk.describe(), (f.rec.turn, 0.05), color="C3", fontsize=8, rotation=90)
    ax.set_xlabel("turn")
    ax.set_ylabel("fraction of the prompt")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    return ""


def _plot_pauses(axes: Any, diag: Diagnosis) -> str:
    import numpy as np

    ax = axes[0]
    by_tool: dict[str, list[float]] = defaultdict(list)
    for f in diag.facts:
        if f.pause_before_s is not None:
            by_tool[f.tool_before or "?"].append(max(f.pause_before_s, 1e-3))
    if not by_tool:
        return "no pauses recorded"
    for i, (tool, xs) in enumerate(sorted(by_tool.items())):
        xs = sorted(xs)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color=f"C{i % 10}",
                label=f"{tool} (n={len(xs)}, median {np.median(xs):.3g} s)")
    for ttl, name in ((300, "5 min"), (1800, "30 min"), (3600, "1 h")):
        ax.axvline(ttl, color="#8c959f", ls=":", lw=1)
        ax.annotate(name, (ttl, 0.02), fontsize=8, color="#57606a")
    ax.set_xscale("log")
    ax.set_xlabel("pause (s)")
    ax.set_ylabel("fraction of pauses <= x")
    ax.legend(loc="upper left", fontsize=8)
    return ""


def _plot_speed(axes: Any, diag: Diagnosis) -> str:
    timed = [f for f in diag.facts if f.rec.speed_s is not None]
    if not timed:
        return "no time to first token or latency in this source (a replay trace has none)"
    label = "TTFT (s)" if all(f.rec.ttft_s is not None for f in timed) else "TTFT or latency (s)"
    cold = [bool(f.cold) or f.brk is not None or f.index == 0 for f in timed]
    for ax, xs, xlabel in ((axes[0], [f.pause_before_s or 0.0 for f in timed], "pause before the turn (s)"),
                           (axes[1], [f.reuse_fraction for f in timed], "prefix repeated from the previous turn")):
        ys = [f.rec.speed_s for f in timed]
        for want, style in ((False, {"color": "C0", "label": "warm"}),
                            (True, {"color": "C3", "marker": "^", "label": "cold or changed prefix"})):
            pts = [(x, y) for x, y, c in zip(xs, ys, cold, strict=True) if c == want]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, **style)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    return ""


def _plot_nodes(axes: Any, diag: Diagnosis) -> str:
    ax = axes[0]
    rows = diag.finding("hotspot").rows
    if not rows:
        return "no node recorded (hosted APIs do not name one): no per-node load"
    names = [r["node"] for r in rows]
    ax.bar(names, [r["busy_share"] for r in rows], color="C2", label="share of busy time")
    ax.bar(names, [r["turns"] / max(1, sum(x["turns"] for x in rows)) for r in rows], color="C0", alpha=0.5,
           width=0.4, label="share of turns")
    ax.axhline(1 / len(rows), color="#8c959f", ls=":", lw=1)
    ax.set_ylabel("share")
    ax.legend(fontsize=8)
    return ""


def render_html(diag: Diagnosis) -> str:
    rows = "".join(
        f'<tr><td>{html.escape(f.question)}</td><td class="status" style="color:{_STATUS_COLOR[f.status]}">'
        f"{f.status}</td><td>{html.escape(f.verdict)}</td></tr>" for f in diag.findings)
    breaks = diag.finding("early_blocks").rows
    break_table = ""
    if breaks:
        head = "".join(f"<th>{html.escape(k)}</th>" for k in breaks[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
                       for r in breaks[:30])
        break_table = f"<h2>Where the prefix broke</h2><table><tr>{head}</tr>{body}</table>"
    plots = "".join([
        "<h2>Prefix reuse per turn</h2>",
        _figure(_plot_reuse, diag, "Per session: the fraction of each prompt repeated from the previous turn, and the "
                "fraction the provider reported cached; red lines mark a changed early block."),
        "<h2>Pause distribution per tool</h2>",
        _figure(_plot_pauses, diag, "Empirical distribution of the pause before each turn, by tool; dotted lines at "
                "common cache TTLs."),
        "<h2>Time to first token</h2>",
        _figure(_plot_speed, diag, "Against the pause before the turn (left) and the prefix repeated (right).",
                ncols=2, figsize=(11, 3.6)),
        "<h2>Per-node load</h2>",
        _figure(_plot_nodes, diag, "Share of busy time and of turns per node; the dotted line is an even share."),
    ])
    title = f"hintflow diagnose: {Path(diag.path).name}"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<div class=\"meta\">{diag.source}: {diag.num_programs} programs, {diag.num_sessions} sessions, "
            f"{diag.num_turns} turns</div><h2>Six questions</h2><table><tr><th>question</th><th>status</th>"
            f"<th>verdict</th></tr>{rows}</table>{break_table}{plots}</body></html>\n")


def write_html(diag: Diagnosis, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_html(diag), encoding="utf-8")
    return path
