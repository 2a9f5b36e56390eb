"""Routing-log files for the analytics tests, in both formats of the writer contract.

Parquet: ``routelog-<server>-<UTC stamp>-<counter>.parquet``, zstd, exactly
the contract's columns and types (written with pyarrow, as the broker's
writer does).  JSON Lines: the broker's line format (broker/observability/
routelog/record.py).  ``hidden=True`` writes the ``.NAME.tmp`` name a file has
while the broker writes it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("time_us", pa.int64()), ("server", pa.int64()), ("lname", pa.string()),
    ("proto", pa.string()), ("user", pa.string()), ("group", pa.string()),
    ("instance", pa.string()), ("to", pa.string()), ("seq", pa.string()),
    ("size", pa.int64()), ("recipients", pa.map_(pa.string(), pa.int64())),
    ("delivered", pa.int64()), ("undeliverable", pa.bool_()),
])
FIELDS = tuple(SCHEMA.names)


def record(time_us: int, group: str, *, lname: str = "ab_1@host", proto: str = "skan",
           user: str | None = None, size: int = 100, recipients: dict[str, int] | None = None,
           server: int = 1, seq: str = "1", instance: str = "*", to: str = "*"
           ) -> dict[str, Any]:
    rcpt = dict(sorted((recipients or {}).items()))
    delivered = sum(rcpt.values())
    return {"time_us": time_us, "server": server, "lname": lname, "proto": proto, "user": user,
            "group": group, "instance": instance, "to": to, "seq": seq, "size": size,
            "recipients": rcpt, "delivered": delivered, "undeliverable": delivered == 0}


def file_name(records: list[dict[str, Any]], fmt: str, counter: int = 1,
              hidden: bool = False) -> str:
    first = records[0]["time_us"] if records else 1_700_000_000_000_000
    secs, micros = divmod(first, 1_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs))
    server = records[0]["server"] if records else 1
    name = f"routelog-{server}-{stamp}.{micros:06d}Z-{counter:06d}.{fmt}"
    return f".{name}.tmp" if hidden else name


def write_parquet(directory: str | os.PathLike, records: list[dict[str, Any]],
                  counter: int = 1, hidden: bool = False) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file_name(records, "parquet", counter, hidden))
    columns = {f: [r[f] for r in records] for f in FIELDS}
    columns["recipients"] = [list(r["recipients"].items()) for r in records]
    pq.write_table(pa.table(columns, schema=SCHEMA), path, compression="zstd")
    return path


def json_line(r: dict[str, Any]) -> str:
    """The broker's line: its field order, no spaces."""
    return json.dumps({f: r[f] for f in FIELDS}, separators=(",", ":")) + "\n"


def write_jsonl(directory: str | os.PathLike, records: list[dict[str, Any]],
                counter: int = 1, hidden: bool = False, torn_tail: str = "") -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file_name(records, "jsonl", counter, hidden))
    with open(path, "w") as f:
        f.write("".join(json_line(r) for r in records) + torn_tail)
    return path
