"""What a routing-log directory holds, listed before Spark reads it (no Spark here).

The broker writes ``routelog-<server>-<UTC stamp>-<counter>.<format>`` files,
``jsonl`` (JSON Lines, the original format) or ``parquet`` (zstd, the record
columns), each under a hidden ``.NAME.tmp`` until it is complete.  The
listing tells the jobs:

- which formats are present, so a directory of Parquet files is read by the
  Parquet reader alone (no JSON pass over an empty set) and a mixed one is the
  union of both;
- which brokers wrote (the server id is in the name), so the cross-broker
  de-duplication runs only when several did;
- the files still being written (``.tmp``), which a batch report cannot
  include: how many records they hold where that can be known (complete
  lines of a JSONL file; a Parquet file is unreadable before its footer is
  written), so the report says what it left out.

Only local directories (``file://`` or a plain path) are listed; a remote URL
(``hdfs://``, ``s3a://``) is left to Spark and reported as unknown.
"""

from __future__ import annotations

import calendar
import contextlib
import fnmatch
import glob
import os
import re
import time

import attrs

PREFIX = "routelog-"
FORMATS = ("parquet", "jsonl")
# Finished files of each format (Spark's pathGlobFilter for that reader).
GLOBS = {fmt: f"{PREFIX}*.{fmt}" for fmt in FORMATS}
LOG_GLOBS = tuple(GLOBS.values())
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"routelog-(\d+)-(\d{8}T\d{6})(?:\.(\d{6}))?Z-(\d+)\.(jsonl|parquet)\Z")
# Counting the complete lines of an open JSONL file reads it: stop past this
# many bytes per file (the writer rotates at 64 MiB by default) and say so.
COUNT_LINES_LIMIT = 1 << 30


@attrs.frozen
class LogName:
    server: int
    opened: float  # Unix seconds (UTC) when the broker opened the file
    counter: int
    fmt: str


def parse_name(name: str) -> LogName | None:
    """The parts of a routing-log file name (finished or ``.NAME.tmp``), or None."""
    if name.startswith(".") and name.endswith(TMP_SUFFIX):
        name = name[1:-len(TMP_SUFFIX)]
    m = _NAME.match(name)
    if m is None:
        return None
    server, stamp, micros, counter, fmt = m.groups()
    opened = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%S"))
    return LogName(int(server), opened + int(micros or 0) / 1e6, int(counter), fmt)


@attrs.frozen
class OpenFile:
    """A routing-log file still being written (or left hidden by a broker that died)."""

    path: str
    fmt: str
    size: int
    opened: float | None
    # Complete lines of a JSONL file (None: Parquet, unreadable until complete).
    records: int | None


@attrs.define
class Inventory:
    """The log directories' finished files by format, their brokers, and the open files."""

    paths: list[str]
    files: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(FORMATS, 0))
    bytes: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(FORMATS, 0))
    servers: set[int] = attrs.Factory(set)
    unnamed: int = 0  # finished files whose name gives no server id
    open_files: list[OpenFile] = attrs.Factory(list)
    remote: bool = False  # some path could not be listed: formats and brokers unknown

    @property
    def total(self) -> int:
        return sum(self.files.values())

    def formats(self) -> list[str]:
        """Formats to read: those present, or every format when a path is remote."""
        return list(FORMATS) if self.remote else [f for f in FORMATS if self.files[f]]

    def single_broker(self) -> bool:
        """True when the names show that one broker wrote every file."""
        return not self.remote and not self.unnamed and len(self.servers) <= 1


def local_path(path: str) -> str | None:
    """The local path of ``path``, or None for a remote URL (hdfs://, s3a://...)."""
    if path.startswith("file://"):
        return path[len("file://"):]
    if "://" in path:
        return None
    return path


def count_lines(path: str) -> int:
    """Complete lines (newline-terminated) in the first COUNT_LINES_LIMIT bytes of ``path``."""
    n = 0
    with open(path, "rb") as f:
        read = 0
        while read < COUNT_LINES_LIMIT:
            block = f.read(1 << 20)
            if not block:
                break
            n += block.count(b"\n")
            read += len(block)
    return n


def scan(paths: list[str], *, open_records: bool = True) -> Inventory:
    """List every local directory of ``paths`` (a glob matches several).

    ``open_records``: count the complete lines of open JSONL files (reads them).
    """
    inv = Inventory(list(paths))
    for path in paths:
        local = local_path(path)
        if local is None:
            inv.remote = True
            continue
        dirs = sorted(glob.glob(local)) if glob.has_magic(local) else [local]
        for d in dirs:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                full = os.path.join(d, name)
                if name.startswith(".") and name.endswith(TMP_SUFFIX):
                    parsed = parse_name(name)
                    if parsed is None:
                        continue
                    try:
                        size = os.path.getsize(full)
                        records = (count_lines(full) if parsed.fmt == "jsonl" and open_records
                                   else None)
                    except OSError:  # completed (renamed) meanwhile
                        continue
                    inv.open_files.append(OpenFile(full, parsed.fmt, size, parsed.opened,
                                                   records))
                    continue
                fmt = next((f for f, g in GLOBS.items() if fnmatch.fnmatch(name, g)), None)
                if fmt is None:
                    continue
                inv.files[fmt] += 1
                with contextlib.suppress(OSError):  # removed by retention meanwhile
                    inv.bytes[fmt] += os.path.getsize(full)
                parsed = parse_name(name)
                if parsed is None:
                    inv.unnamed += 1
                else:
                    inv.servers.add(parsed.server)
    return inv


def left_out_note(inv: Inventory) -> str | None:
    """One sentence on the open files a batch report could not include, or None."""
    if not inv.open_files:
        return None
    counted = sum(f.records or 0 for f in inv.open_files if f.records is not None)
    unknown = [f for f in inv.open_files if f.records is None]
    since = min((f.opened for f in inv.open_files if f.opened is not None), default=None)
    parts = []
    if counted or len(unknown) < len(inv.open_files):
        parts.append(f"{counted:,} record(s)")
    if unknown:
        size = sum(f.size for f in unknown)
        parts.append(f"the records of {len(unknown)} Parquet file(s) ({size:,} bytes so far; "
                     "a Parquet file cannot be read before it is complete)")
    when = ""
    if since is not None:
        when = f", written since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(since))} UTC"
    names = ", ".join(os.path.basename(f.path) for f in inv.open_files[:3])
    more = f" and {len(inv.open_files) - 3} more" if len(inv.open_files) > 3 else ""
    return (f"Not included: {' and '.join(parts)} in {len(inv.open_files)} file(s) still being "
            f"written ({names}{more}){when}. A log file is read once the broker completes it "
            "(at rotation, [log] rotate_seconds / rotate_bytes, or when it stops); run the "
            "report again then.")
