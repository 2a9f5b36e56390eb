"""Reading a routing-log directory in tests: complete files only, every line checked."""

from __future__ import annotations

import json
import pathlib

from broker.observability.routelog.files import LOCK_NAME


def visible_files(log_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in log_dir.iterdir() if not p.name.startswith((".", "_")))


def hidden_files(log_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in log_dir.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME)


def read_log(log_dir: pathlib.Path) -> list[dict]:
    """Every record of every published file; fails on a torn or invalid line."""
    records = []
    for path in visible_files(log_dir):
        data = path.read_bytes()
        assert data.endswith(b"\n"), f"{path.name} does not end with a complete line"
        records += [json.loads(line) for line in data.splitlines()]
    return records
