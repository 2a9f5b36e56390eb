"""What a report is, apart from how it is computed (report.py) and drawn (render.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import attrs


@attrs.define
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@attrs.define
class Report:
    log_dir: str
    totals: dict[str, Any]
    tables: dict[str, Table]
    # What the reader must know about the figures (e.g. records left out).
    notes: list[str] = attrs.Factory(list)
    charts: dict[str, str] = attrs.Factory(dict)  # view name -> PNG path
    html: str | None = None

    def to_json(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            return value.isoformat() if isinstance(value, dt.datetime) else value

        return {
            "log_dir": self.log_dir,
            "notes": list(self.notes),
            "totals": {k: plain(v) for k, v in self.totals.items()},
            "tables": {
                name: {"title": t.title, "columns": t.columns,
                       "rows": [[plain(v) for v in row] for row in t.rows]}
                for name, t in self.tables.items()
            },
        }
