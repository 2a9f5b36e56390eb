"""Rendering a :class:`~analytics.model.Report`: text tables, PNG charts, HTML.

Charts use matplotlib's object API with the Agg canvas (no display, no
pyplot global state).  The HTML page is self-contained: the PNGs are
embedded as base64 data URIs and the style sheet is inline.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import numbers
import os
from typing import Any

from matplotlib import dates as mdates
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from analytics.model import Report, Table

# Longest label drawn on a chart axis (group names and lnames can be long).
LABEL_CHARS = 28
# Chart size in inches at DPI: 1,200 px wide, sharp when the page shows it
# at half that on a high-density screen or a phone.
CHART_WIDTH = 8
DPI = 150
# A minute of the per-minute chart is "partial" when the log covers less of
# it than this (the log started or ended inside it).
FULL_MINUTE = dt.timedelta(seconds=59)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.2%}" if 0 <= value <= 1 else f"{value:,.2f}"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    return "" if value is None else str(value)


def table_text(table: Table) -> str:
    cells = [[_cell(v) for v in row] for row in table.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(table.columns)]
    numeric = [bool(table.rows) and all(isinstance(r[i], int | float) for r in table.rows)
               for i in range(len(table.columns))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    out = [table.title, line(table.columns), line(["-" * w for w in widths])]
    out += [line(r) for r in cells] or ["(none)"]
    return "\n".join(out)


def totals_text(report: Report) -> str:
    t = report.totals
    span = ""
    if t.get("first") and t.get("last"):
        span = f"  from {t['first']:%Y-%m-%d %H:%M:%S} to {t['last']:%Y-%m-%d %H:%M:%S} UTC"
    return (f"Routing log {report.log_dir}{span}\n"
            f"{t['messages']:,} messages, {t['bytes']:,} bytes, {t['deliveries']:,} deliveries, "
            f"{t['undeliverable']:,} undeliverable; {t['groups']:,} groups, "
            f"{t['senders']:,} senders")


def text(report: Report) -> str:
    parts = [totals_text(report)] + [f"Note: {n}" for n in report.notes]
    for name, table in report.tables.items():
        if name == "per_minute" and len(table.rows) > 30:
            shown = Table(table.title + f" (last 30 of {len(table.rows)})", table.columns,
                          table.rows[-30:])
            parts.append(table_text(shown))
        else:
            parts.append(table_text(table))
    return "\n\n".join(parts)


# ---- charts ------------------------------------------------------------------


def _short(label: Any) -> str:
    s = str(label)
    return s if len(s) <= LABEL_CHARS else s[: LABEL_CHARS - 1] + "…"


def _figure(height: float = 3.6) -> tuple[Figure, Any]:
    fig = Figure(figsize=(CHART_WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _number(value: Any) -> str:
    """A count with thousands separators: Python or numpy numbers (bar values are numpy)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{float(value):,.2f}"


def _tick(value: float, _pos: Any = None) -> str:
    return _number(value)


def _count_axis(axis: Any) -> None:
    """Ticks on whole numbers only (a count of 2.5 messages means nothing), with separators."""
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axis.set_major_formatter(FuncFormatter(_tick))


def _barh(table: Table, label: str, value: str, title: str, xlabel: str) -> Figure:
    li, vi = table.columns.index(label), table.columns.index(value)
    rows = list(reversed(table.rows))  # biggest on top
    fig, ax = _figure(max(2.4, 0.6 + 0.32 * len(rows)))
    bars = ax.barh([_short(r[li]) for r in rows], [r[vi] for r in rows], color="#3b73b9")
    _label(ax, bars, horizontal=True)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    _count_axis(ax.xaxis)
    return fig


def _label(ax: Any, bars: Any, horizontal: bool = False) -> None:
    """Write each bar's value at its end, so a small bar beside a big one still reads."""
    ax.bar_label(bars, labels=[_number(v) for v in bars.datavalues], padding=3, fontsize=8)
    # Room for the label past the longest bar.
    if horizontal:
        ax.margins(x=0.15)
    else:
        ax.margins(y=0.15)


def sender_label(lname: str, proto: str, user: str | None = None) -> str:
    """``proto  user  lname`` with the lname shortened, never the protocol or the user."""
    who = f"{user}  " if user else ""
    return f"{proto}  {who}{_short(lname)}"


def minute_series(rows: list[list[Any]]) -> list[list[Any]]:
    """Per-minute rows with every minute between the first and last, absent ones as zero."""
    if not rows:
        return []
    by_minute = {r[0]: r for r in rows}
    width = len(rows[0])
    out = []
    minute = rows[0][0]
    last = rows[-1][0]
    while minute <= last:
        out.append(by_minute.get(minute, [minute] + [0] * (width - 1)))
        minute += dt.timedelta(minutes=1)
    return out


def partial_minutes(rows: list[list[Any]], first: dt.datetime | None,
                    last: dt.datetime | None) -> tuple[bool, bool]:
    """Whether the first and the last minute of the series are only partly in the log."""
    if not rows or first is None or last is None:
        return False, False
    start, end = rows[0][0], rows[-1][0] + dt.timedelta(minutes=1)
    head = start + dt.timedelta(minutes=1) - max(first, start) < FULL_MINUTE
    tail = min(last, end) - (end - dt.timedelta(minutes=1)) < FULL_MINUTE
    return head, tail


def _per_minute(series: Table, first: dt.datetime | None,
                last: dt.datetime | None) -> Figure:
    fig, ax = _figure()
    filled = minute_series(series.rows)
    head, tail = partial_minutes(filled, first, last)
    n = len(filled)
    # Full minutes: solid line; a partial first or last minute: its point
    # hollow, joined by a dotted line, so that a minute the log covers only
    # in part does not read as a fall (or rise) of traffic.
    lo, hi = (1 if head and n > 1 else 0), (n - 1 if tail and n > 1 else n)
    minutes = [r[0] + dt.timedelta(seconds=30) for r in filled]  # drawn mid-minute
    for col, label, color in ((1, "messages", "C0"), (3, "deliveries", "C1"),
                              (4, "undeliverable", "C3")):
        ys = [r[col] for r in filled]
        ax.plot(minutes[lo:hi], ys[lo:hi], marker="o", markersize=3, color=color, label=label)
        for i, partial in ((0, head), (n - 1, tail)):
            if partial:
                j = min(max(i + (1 if i == 0 else -1), 0), n - 1)
                ax.plot([minutes[i], minutes[j]], [ys[i], ys[j]], linestyle=":", color=color)
                ax.plot([minutes[i]], [ys[i]], marker="o", markersize=6, color=color,
                        markerfacecolor="white", linestyle="none")
    if head or tail:
        ax.plot([], [], marker="o", markerfacecolor="white", color="grey", linestyle=":",
                label="partial minute")
    ax.set_ylim(bottom=0)
    ax.set_title("Traffic per minute")
    ax.set_ylabel("per minute")
    ax.set_xlabel("time (UTC), one point per minute")
    _count_axis(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    span = filled[-1][0] - filled[0][0]
    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    if span < dt.timedelta(minutes=3):
        locator = mdates.MinuteLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.DateFormatter(
        "%H:%M" if span < dt.timedelta(days=1) else "%m-%d %H:%M"))
    if n == 1:  # one point: give it a minute either side
        ax.set_xlim(filled[0][0] - dt.timedelta(minutes=1),
                    filled[0][0] + dt.timedelta(minutes=2))
    return fig


def write_charts(report: Report, out_dir: str) -> dict[str, str]:
    """One PNG per view that has data; returns {view: path}."""
    charts: dict[str, str] = {}
    for name, fig in figures(report).items():
        charts[name] = os.path.join(out_dir, f"{name}.png")
        fig.savefig(charts[name])
    return charts


def figures(report: Report) -> dict[str, Figure]:
    """A chart per view that has data: {view: matplotlib Figure}."""
    figs: dict[str, Figure] = {}
    tables = report.tables

    if tables["groups_by_messages"].rows:
        figs["groups_by_messages"] = _barh(tables["groups_by_messages"], "group", "messages",
                                           "Top groups by messages", "messages")
    if tables["groups_by_bytes"].rows:
        figs["groups_by_bytes"] = _barh(tables["groups_by_bytes"], "group", "bytes",
                                        "Top groups by bytes", "bytes")
    senders = tables["top_senders"]
    if senders.rows:
        labelled = Table(senders.title, ["sender", "messages"],
                         [[sender_label(r[0], r[1], r[2]), r[3]] for r in senders.rows])
        figs["top_senders"] = _barh(labelled, "sender", "messages",
                                    "Top senders by messages", "messages")
    if tables["undeliverable"].rows:
        figs["undeliverable"] = _barh(tables["undeliverable"], "group", "undeliverable",
                                      "Undeliverable messages by group",
                                      "messages without a recipient")
    fan = tables["fanout"]
    if any(r[1] for r in fan.rows):
        fig, ax = _figure()
        bars = ax.bar([r[0] for r in fan.rows], [r[1] for r in fan.rows], color="#5a9e4b")
        _label(ax, bars)
        ax.set_title("Fan-out distribution")
        ax.set_xlabel("copies delivered per message")
        ax.set_ylabel("messages")
        _count_axis(ax.yaxis)
        figs["fanout"] = fig
    mix = tables["protocols"]
    if mix.rows:
        fig, ax = _figure()
        xs = range(len(mix.rows))
        for bars in (
            ax.bar([x - 0.2 for x in xs], [r[1] for r in mix.rows], width=0.4,
                   label="messages sent"),
            ax.bar([x + 0.2 for x in xs], [r[4] for r in mix.rows], width=0.4,
                   label="copies delivered"),
        ):
            _label(ax, bars)
        ax.set_xticks(list(xs), [r[0] for r in mix.rows])
        ax.set_title("Protocol mix")
        ax.set_ylabel("messages")
        _count_axis(ax.yaxis)
        # Beside the plot, never over a bar.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  frameon=False)
        figs["protocols"] = fig
    series = tables["per_minute"]
    if series.rows:
        figs["per_minute"] = _per_minute(series, report.totals.get("first"),
                                         report.totals.get("last"))
    return figs


# ---- HTML --------------------------------------------------------------------

# One column on a phone; on a wider screen the views side by side in as
# many columns of at least 36em as fit (two on a laptop, three on a wide
# monitor).  Charts scale with their column; a table wider than its column
# scrolls inside it, never the page.
_STYLE = """
*, *::before, *::after { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 1em clamp(.6em, 2vw, 2em);
       max-width: 150em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin: .3em 0; } h2 { font-size: 1.1em; margin: 0 0 .5em; }
.summary { font-size: 1.05em; }
.note { background: #fff4d6; border-left: .3em solid #e0a800; padding: .5em .8em; }
.views { display: grid; gap: 1.5em 2em;
         grid-template-columns: repeat(auto-fill, minmax(min(100%, 36em), 1fr)); }
section { min-width: 0; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { padding: .2em .7em; border-bottom: 1px solid #ddd; white-space: nowrap; }
th { text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
img { width: 100%; height: auto; display: block; }
@media (max-width: 40em) { body { font-size: 15px; } th, td { padding: .2em .4em; } }
"""


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = []
    for row in table.rows:
        cells = "".join(
            f'<td class="n">{html.escape(_cell(v))}</td>' if isinstance(v, int | float)
            and not isinstance(v, bool)
            else f"<td>{html.escape(_cell(v))}</td>" for v in row)
        body.append(f"<tr>{cells}</tr>")
    rows = "".join(body) or f'<tr><td colspan="{len(table.columns)}">(none)</td></tr>'
    return f'<div class="scroll"><table><tr>{head}</tr>{rows}</table></div>'


def _img(path: str, alt: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_html(report: Report, path: str) -> str:
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>Skan routing report</title>", f"<style>{_STYLE}</style></head><body>",
        "<h1>Skan routing report</h1>",
        '<p class="summary">' + html.escape(totals_text(report)).replace("\n", "<br>") + "</p>",
    ]
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in report.notes]
    parts.append('<div class="views">')
    for name, table in report.tables.items():
        parts.append(f"<section><h2>{html.escape(table.title)}</h2>")
        if name in report.charts:
            parts.append(_img(report.charts[name], table.title))
        parts.append(_html_table(table) + "</section>")
    parts.append("</div></body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return path
