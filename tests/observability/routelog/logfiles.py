"""Reading a routing-log directory in tests: complete files only, every record checked.

Parquet files are read back with pyarrow (schema checked against the
writer's); JSON Lines files line by line.  Both give the same dicts: a
record as its JSON line reads (``recipients`` a dict).
"""

from __future__ import annotations

import json
import pathlib

import pyarrow.parquet as pq

from broker.observability.routelog.files import LOCK_NAME
from broker.observability.routelog.parquet import SCHEMA


def visible_files(log_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in log_dir.iterdir() if not p.name.startswith((".", "_")))


def hidden_files(log_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in log_dir.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME)


def read_file(path: pathlib.Path) -> list[dict]:
    """One published file's records; fails on a torn line or a schema that is not the writer's."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        assert table.schema.equals(SCHEMA), table.schema
        records = table.to_pylist()
        for r in records:
            r["recipients"] = dict(r["recipients"])
        return records
    assert path.suffix == ".jsonl", path.name
    data = path.read_bytes()
    assert data.endswith(b"\n"), f"{path.name} does not end with a complete line"
    return [json.loads(line) for line in data.splitlines()]


def read_log(log_dir: pathlib.Path) -> list[dict]:
    """Every record of every published file, in file order."""
    records = []
    for path in visible_files(log_dir):
        records += read_file(path)
    return records
