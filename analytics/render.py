"""Rendering a :class:`~analytics.model.Report`: text tables, PNG charts, HTML.

Charts use matplotlib's object API with the Agg canvas (no display, no
pyplot global state).  The HTML page is self-contained: the PNGs are
embedded as base64 data URIs and the style sheet is inline.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import os
from typing import Any

from matplotlib import dates as mdates
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

from analytics.model import Report, Table

# Longest label drawn on a chart axis (group names and lnames can be long).
LABEL_CHARS = 28
THOUSANDS = "{x:,.0f}"


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
    parts = [totals_text(report)]
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
    fig = Figure(figsize=(8, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _barh(path: str, table: Table, label: str, value: str, title: str, xlabel: str) -> None:
    li, vi = table.columns.index(label), table.columns.index(value)
    rows = list(reversed(table.rows))  # biggest on top
    fig, ax = _figure(max(2.4, 0.6 + 0.32 * len(rows)))
    bars = ax.barh([_short(r[li]) for r in rows], [r[vi] for r in rows], color="#3b73b9")
    _label(ax, bars, horizontal=True)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    fig.savefig(path)


def _number(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)


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


def write_charts(report: Report, out_dir: str) -> dict[str, str]:
    """One PNG per view that has data; returns {view: path}."""
    charts: dict[str, str] = {}
    tables = report.tables

    def target(name: str) -> str:
        path = os.path.join(out_dir, f"{name}.png")
        charts[name] = path
        return path

    if tables["groups_by_messages"].rows:
        _barh(target("groups_by_messages"), tables["groups_by_messages"], "group", "messages",
              "Top groups by messages", "messages")
    if tables["groups_by_bytes"].rows:
        _barh(target("groups_by_bytes"), tables["groups_by_bytes"], "group", "bytes",
              "Top groups by bytes", "bytes")
    senders = tables["top_senders"]
    if senders.rows:
        labelled = Table(senders.title, ["sender", "messages"],
                         [[sender_label(r[0], r[1], r[2]), r[3]] for r in senders.rows])
        _barh(target("top_senders"), labelled, "sender", "messages",
              "Top senders by messages", "messages")
    if tables["undeliverable"].rows:
        _barh(target("undeliverable"), tables["undeliverable"], "group", "undeliverable",
              "Undeliverable messages by group", "messages without a recipient")
    fan = tables["fanout"]
    if any(r[1] for r in fan.rows):
        fig, ax = _figure()
        bars = ax.bar([r[0] for r in fan.rows], [r[1] for r in fan.rows], color="#5a9e4b")
        _label(ax, bars)
        ax.set_title("Fan-out distribution")
        ax.set_xlabel("copies delivered per message")
        ax.set_ylabel("messages")
        ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
        fig.savefig(target("fanout"))
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
        ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
        ax.legend()
        fig.savefig(target("protocols"))
    series = tables["per_minute"]
    if series.rows:
        fig, ax = _figure()
        filled = minute_series(series.rows)
        minutes = [r[0] for r in filled]
        ax.plot(minutes, [r[1] for r in filled], marker=".", label="messages")
        ax.plot(minutes, [r[3] for r in filled], marker=".", label="deliveries")
        ax.plot(minutes, [r[4] for r in filled], marker=".", label="undeliverable")
        ax.set_ylim(bottom=0)
        ax.set_title("Traffic per minute (UTC)")
        ax.set_ylabel("per minute")
        ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
        ax.legend()
        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        fig.savefig(target("per_minute"))
    return charts


# ---- HTML --------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { padding: .2em .7em; border-bottom: 1px solid #ddd; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; }
"""


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = []
    for row in table.rows:
        cells = "".join(
            f'<td class="n">{html.escape(_cell(v))}</td>' if isinstance(v, int | float)
            else f"<td>{html.escape(_cell(v))}</td>" for v in row)
        body.append(f"<tr>{cells}</tr>")
    rows = "".join(body) or f'<tr><td colspan="{len(table.columns)}">(none)</td></tr>'
    return f"<table><tr>{head}</tr>{rows}</table>"


def _img(path: str, alt: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_html(report: Report, path: str) -> str:
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>Skan routing report</title>", f"<style>{_STYLE}</style></head><body>",
        "<h1>Skan routing report</h1>",
        "<p>" + html.escape(totals_text(report)).replace("\n", "<br>") + "</p>",
    ]
    for name, table in report.tables.items():
        parts.append(f"<h2>{html.escape(table.title)}</h2>")
        if name in report.charts:
            parts.append(_img(report.charts[name], table.title))
        parts.append(_html_table(table))
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return path
