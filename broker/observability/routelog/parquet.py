"""Routing-log records as Parquet: the schema, batches to Arrow, row groups to bytes (no I/O).

The routing thread appends each record's changing values to flat buffers
(:mod:`.columns`, compiled); the writer thread makes Arrow arrays of them
as they are, a row group's hand-offs at once (:func:`columns_to_table`: no
Python step per record) and
encodes row groups with pyarrow's Parquet writer (C++, zstd).  Encoded
bytes go to a memory sink and from there to the file through
:class:`.files.LogFile`'s resumable writes, so a disk error is retried
byte-exactly, as for JSON Lines, and never leaves the Parquet writer in an
unknown state.  :func:`lines_to_table` reads JSON lines into the same table
(tools, tests).

Column names and meaning are :data:`.record.FIELDS`; ``recipients`` is a
``map<string, int64>`` (protocol -> copies, sorted by protocol).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

# Imported here, not by pyarrow on the first Array.take: that import (30-50 ms
# of Python) ran in the writer thread at the first hand-off, holding the
# interpreter the routing thread needed (a fresh broker's first 100 ms of
# traffic had latencies up to 60 ms).  RoutingLog's constructor loads this
# module before the broker serves.
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from broker.observability.routelog.columns import Columns
from broker.observability.routelog.record import FIELDS

SCHEMA = pa.schema([
    ("time_us", pa.int64()),
    ("server", pa.int64()),
    ("lname", pa.string()),
    ("proto", pa.string()),
    ("user", pa.string()),
    ("group", pa.string()),
    ("instance", pa.string()),
    ("to", pa.string()),
    ("seq", pa.string()),
    ("size", pa.int64()),
    ("recipients", pa.map_(pa.string(), pa.int64())),
    ("delivered", pa.int64()),
    ("undeliverable", pa.bool_()),
])
assert tuple(SCHEMA.names) == FIELDS

# The JSON reader cannot convert to a map: recipients is read as a struct
# (one field per protocol seen) and converted by _recipients_map.
_READ_SCHEMA = pa.schema([f for f in SCHEMA if f.name != "recipients"])
_PARSE = pa_json.ParseOptions(explicit_schema=_READ_SCHEMA, unexpected_field_behavior="infer")

# Rows per Parquet row group.  Measured on the issue-26 traffic (20
# publishers, 50 groups, 8 subscribers): 16,384 rows give 6.0 bytes/record,
# 65,536 give 4.6, 131,072 give 4.4; the writer holds one row group of
# columns (~60 bytes a row in Arrow), so 65,536 keeps that under 4 MB.
ROW_GROUP_ROWS = 65_536
# Time and size columns: delta encoding (time_us grows by a few
# microseconds a record) takes fewer bytes than zstd over plain int64.
_DELTA = ("time_us", "size")
COMPRESSION = "zstd"
# Bytes Arrow buffers before handing encoded pages to the Python sink: a row
# group of the issue-26 traffic is 0.3-4 MB, so one to four hand-overs.
SINK_BUFFER = 1 << 20


def lines_to_table(lines: list[str]) -> pa.Table:
    """The Arrow table of some routing-log JSON lines (each ending in a newline)."""
    data = "".join(lines).encode()
    options = pa_json.ReadOptions(use_threads=False, block_size=max(1 << 20, len(data) + 1))
    read = pa_json.read_json(io.BytesIO(data), read_options=options, parse_options=_PARSE)
    columns = []
    for field in SCHEMA:
        if field.name == "recipients":
            columns.append(_recipients_map(read.column("recipients").combine_chunks()))
        else:
            columns.append(read.column(field.name))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


_PART_FIELDS = ("server", "lname", "proto", "user", "group", "instance", "to", "recipients",
                "delivered", "undeliverable")
_PARTS_TYPE = pa.struct([SCHEMA.field(n) for n in _PART_FIELDS])


class PartsTable:
    """The writer's copy of the routing thread's parts table (:mod:`.columns`), as Arrow."""

    def __init__(self) -> None:
        self.epoch = 0
        self.parts = pa.array([], _PARTS_TYPE)

    def update(self, cols: Columns) -> pa.StructArray:
        if cols.epoch != self.epoch:
            self.epoch = cols.epoch
            self.parts = pa.array([], _PARTS_TYPE)
        if cols.new_parts:
            new = pa.array([dict(zip(_PART_FIELDS, p, strict=True)) for p in cols.new_parts],
                           _PARTS_TYPE)
            self.parts = pa.concat_arrays([self.parts, new]) if len(self.parts) else new
        return self.parts


def _array(kind: pa.DataType, cols: Columns, *buffers: bytearray) -> pa.Array:
    """One column of a batch as an Arrow array over its own buffer(s): no copy."""
    return pa.Array.from_buffers(kind, cols.rows, [None, *map(pa.py_buffer, buffers)])


def _column(kind: pa.DataType, arrays: list[pa.Array]) -> pa.Array:
    # concat_arrays copies in Arrow's C++ with the GIL released (the
    # bytearray joins this replaced held it for 1-3 ms a row group: page
    # faults of the new buffers, in the VM, while routing waited).
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def columns_to_table(batches: Sequence[Columns], table: PartsTable | None = None) -> pa.Table:
    """The Arrow table of hand-off batches of one epoch, in order (:class:`.columns.Columns`).

    The writer keeps a row group's hand-offs as they came and converts them
    here once, when the row group is due: one conversion a row group, not
    one a hand-off.  ``table``: the parts of the epoch so far (updated here
    with each batch's new parts); a fresh one for batches that start their
    epoch (tools, tests).  The batches' seq bytes together must stay within
    int32 offsets (the writer converts before :data:`.columns.MAX_SEQ_BYTES`
    would be passed).
    """
    parts_table = table if table is not None else PartsTable()
    if any(b.epoch != batches[0].epoch for b in batches):
        raise ValueError("hand-off batches of different epochs in one table")
    for b in batches:
        parts_table.update(b)
    parts = parts_table.parts
    rows = [b for b in batches if b.rows]
    if not rows:
        return SCHEMA.empty_table()
    keys = _column(pa.int32(), [_array(pa.int32(), b, b.keys) for b in rows])
    # One take for the ten repeated columns (one call, one pass).
    picked = pc.take(parts, keys)
    server, lname, proto, user, group, instance, to, recipients, delivered, undeliverable = (
        picked.field(i) for i in range(len(_PART_FIELDS)))
    return pa.Table.from_arrays([
        _column(pa.int64(), [_array(pa.int64(), b, b.times) for b in rows]),
        server, lname, proto, user, group, instance, to,
        _column(pa.string(), [_array(pa.string(), b, b.seq_ends, b.seq_data) for b in rows]),
        _column(pa.int64(), [_array(pa.int64(), b, b.sizes) for b in rows]),
        recipients, delivered, undeliverable,
    ], schema=SCHEMA)


def _recipients_map(struct: pa.StructArray) -> pa.MapArray:
    """``{"proto": n}`` objects read as a struct (absent protocol: null) as a map, keys sorted."""
    n = len(struct)
    names = sorted(f.name for f in struct.type)
    if not names:
        return pa.MapArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)),
                                       pa.array([], pa.string()), pa.array([], pa.int64()))
    fields = [struct.field(name) for name in names]
    valid = np.stack([f.is_valid().to_numpy(zero_copy_only=False) for f in fields], axis=1)
    values = np.stack([f.fill_null(0).to_numpy() for f in fields], axis=1)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    which = np.broadcast_to(np.arange(len(names), dtype=np.int32), valid.shape)[valid]
    keys = pa.array(names, pa.string()).take(pa.array(which))
    return pa.MapArray.from_arrays(pa.array(offsets), keys, pa.array(values[valid], pa.int64()))


class _Sink(io.RawIOBase):
    """A write-only file that keeps what is written until :meth:`take`."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self._chunks.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class ParquetEncoder:
    """One Parquet file's bytes, row group by row group (pure: no file I/O)."""

    def __init__(self) -> None:
        self._sink = _Sink()
        # Arrow's own buffer in front of the Python sink: Arrow encodes with
        # the GIL released and calls back into Python (taking the GIL) for
        # every write to a Python file -- 130 calls a row group of 65,536
        # records, each a wait for the routing thread to let go of the
        # interpreter.  Buffered, a row group is one call (the same bytes).
        # In a broker routing 10,000 isolated msgs/s a row group's encoding
        # lasted 122-135 ms (16-27 ms of CPU in process), 86 ms buffered: the
        # rest is the two cores being shared.
        self._stream = pa.BufferedOutputStream(pa.PythonFile(self._sink, mode="w"),
                                               buffer_size=SINK_BUFFER)
        self._writer = pq.ParquetWriter(
            self._stream, SCHEMA, compression=COMPRESSION,
            use_dictionary=[n for n in SCHEMA.names if n not in _DELTA],
            column_encoding=dict.fromkeys(_DELTA, "DELTA_BINARY_PACKED"),
            write_statistics=True)

    def row_group(self, tables: list[pa.Table]) -> bytes:
        """Encode ``tables`` as one row group; returns the bytes to append to the file."""
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self._stream.flush()
        return self._sink.take()

    def finish(self) -> bytes:
        """The rest of the file (the footer)."""
        self._writer.close()
        self._stream.close()
        return self._sink.take()
