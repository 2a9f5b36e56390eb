"""Routing-log records as column buffers: what the Parquet writer encodes (pure, no I/O).

The router observer :class:`ColumnBuffer` appends, per routed message,
only what changes from message to message -- the routing time, the frame
size, the seq and a key -- to flat buffers (bytearrays in Arrow's own
layout).  Everything that repeats (server, lname, proto, user, group,
instance, to, recipients, delivered, undeliverable) is the message's
*parts*: one tuple per (sender, recipient set), as :class:`.record.RecordBuffer`
caches its prefix and suffix, named by its key (its index in the parts
table).  The table only grows, within an *epoch*: each hand-off carries the
parts added since the last one, and the writer keeps the table as Arrow
arrays.  Once it holds :data:`PARTS_CACHE` parts, the next hand-off starts a
new epoch (an empty table).  The writer thread turns a batch into Arrow
arrays without a Python step per record (:func:`.parquet.columns_to_table`:
the buffers become arrays as they are, the parts columns are one ``take``
of the parts table by key), so the per-record work is the compiled append
here, on the routing thread, and pyarrow's C++ in the writer.

broker/_observer_speedups.c ``routelog_columns`` is the compiled loop;
:meth:`ColumnBuffer.observe_py` is its reference (and the fallback).

Values are the record's as a JSON Lines reader decodes them (same column
names and meaning as :data:`.record.FIELDS`): text fields are the bytes as
UTF-8, or, when they are not UTF-8, with each undecodable byte as the four
characters ``\\xNN``.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import attrs

from broker.core.router import Endpoint, Routed, Router
from wire.skan.codec import PURE_PYTHON

_columns_c = None
if not PURE_PYTHON:
    try:
        from broker._observer_speedups import routelog_columns as _columns_c
    except ImportError:  # pragma: no cover - built without a compiler
        _columns_c = None

# Parts in one epoch's table (then a new epoch starts, at a hand-off):
# endless distinct senders, keys or subscription changes cannot grow it.
PARTS_CACHE = 65_536
# Seq bytes a batch may hold before it is handed off (Arrow string offsets
# are int32): far below 2 GiB.
MAX_SEQ_BYTES = 256 * 1024 * 1024

_I64 = struct.Struct("=q")
_I32 = struct.Struct("=i")


def text(value: bytes) -> str:
    """A DATA value as the log's text: UTF-8, or ``\\xNN`` for bytes that are not."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("utf-8", "backslashreplace")


def seq_value(seq: object) -> str:
    """The ``seq`` column's value: empty when the message had none (or not DATA)."""
    return text(seq) if type(seq) is bytes else ""


@attrs.define
class Columns:
    """One hand-off batch: ``rows`` records in flat buffers plus the parts their keys name.

    ``new_parts``: the parts added to ``epoch``'s table since the previous
    hand-off; a key ``k`` names the table's ``k``-th parts, each (server,
    lname, proto, user, group, instance, to, recipients (sorted (proto,
    copies) pairs), delivered, undeliverable).  ``first_at``: time.time()
    when its first record was routed.
    """

    rows: int
    times: bytearray  # int64, native order
    sizes: bytearray  # int64
    keys: bytearray  # int32: index into parts
    seq_ends: bytearray  # int32 end offsets, after a leading 0
    seq_data: bytearray  # UTF-8
    new_parts: list[tuple]
    epoch: int
    first_at: float


def parts_only(cols: Columns) -> Columns:
    """A batch's parts without its records: what the writer still needs of a dropped batch
    (later batches' keys may name these parts)."""
    return Columns(0, bytearray(), bytearray(), bytearray(), bytearray(_I32.pack(0)),
                   bytearray(), cols.new_parts, cols.epoch, cols.first_at)


def _recipients(recipients: tuple[Endpoint, ...], sender: Endpoint) -> tuple:
    counts: dict[str, int] = {}
    for ep in recipients:
        if ep is not sender:
            counts[ep.protocol] = counts.get(ep.protocol, 0) + 1
    return tuple(sorted(counts.items()))


class ColumnBuffer:
    """Router observer: each routed message's record into column buffers.

    The same interface as :class:`.record.RecordBuffer` for the writer
    (``pending``, ``first_at``, ``take``, ``on_full`` at ``limit`` records).
    """

    def __init__(self, limit: int, on_full: Callable[[], None],
                 router: Router | None = None, server: int | None = None) -> None:
        self.server = server if server is not None else (
            router.server_id if router is not None else 0)
        self.limit = limit
        self.on_full = on_full
        self._router = router
        self.first_at = 0.0
        self._epoch = 0
        self._new_epoch()
        self._reset()

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._parts: list[tuple] = []
        self._handed_parts = 0
        # (sender, id(recipients)) or (sender, group, instance, to) -> (key, recipients)
        self._cache: dict[tuple, tuple[int, tuple]] = {}
        self._generation = -1

    def _reset(self) -> None:
        self._times = bytearray()
        self._sizes = bytearray()
        self._keys = bytearray()
        self._seq_ends = bytearray(_I32.pack(0))
        self._seq_data = bytearray()
        self._cols = (self._times, self._sizes, self._keys, self._seq_ends, self._seq_data)

    def pending(self) -> int:
        return len(self._times) >> 3

    def add(self, routed: Routed) -> None:
        self.observe([routed])

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: one record per routed message of the batch."""
        if not self._times:
            self.first_at = time.time()
        if _columns_c is None:
            self.observe_py(batch)
        else:
            # The compiled loop appends every message it can; what it leaves
            # (an odd timestamp or header) goes through the reference.
            cols, parts_of = self._cols, self._parts_of
            i, n = 0, len(batch)
            while i < n:
                i = _columns_c(batch, i, cols, parts_of, seq_value)
                if i < n:
                    self.observe_py(batch[i:i + 1])
                    i += 1
        if len(self._times) >> 3 >= self.limit or len(self._seq_data) >= MAX_SEQ_BYTES:
            self.on_full()

    def observe_py(self, batch: list[Routed]) -> None:
        """The reference of :meth:`observe` (without the on_full check)."""
        for routed in batch:
            key = self._parts_of(routed)[0]
            seq = routed.header.get(b"seq")
            sq = seq if type(seq) is bytes and seq.isdigit() else seq_value(seq).encode()
            self._seq_data += sq
            self._times += _I64.pack(int(routed.timestamp * 1e6))
            self._sizes += _I64.pack(len(routed.frame))
            self._keys += _I32.pack(key)
            self._seq_ends += _I32.pack(len(self._seq_data))

    def _parts_of(self, routed: Routed) -> tuple[int, tuple]:
        """(key, recipient tuple) of a message's parts, made on first sight."""
        recips = routed.recipients
        if recips:
            cache_key: tuple = (routed.sender, id(recips))
        else:
            h = routed.header
            cache_key = (routed.sender, h[b"group"], h[b"instance"], h[b"to"])
        found = self._cache.get(cache_key)
        if found is not None:
            return found
        generation = self._router.generation if self._router is not None else 0
        if generation != self._generation:
            # Entries hold endpoints and tuples alive: dropped at a subscription
            # change (RecordBuffer's rule); the table keeps its parts.
            self._cache.clear()
            self._generation = generation
        sender, h = routed.sender, routed.header
        principal = getattr(sender, "principal", None)
        d = routed.delivered
        self._parts.append((
            self.server, text(sender.lname), sender.protocol,
            None if principal is None or principal.name is None else principal.name,
            text(h[b"group"]), text(h[b"instance"]), text(h[b"to"]),
            _recipients(recips, sender), d, not d))
        found = (len(self._parts) - 1, recips)
        self._cache[cache_key] = found
        return found

    def take(self) -> Columns:
        """The buffered records and the parts added since the last take (empties the buffer)."""
        out = Columns(self.pending(), self._times, self._sizes, self._keys, self._seq_ends,
                      self._seq_data, self._parts[self._handed_parts:], self._epoch,
                      self.first_at)
        self._handed_parts = len(self._parts)
        self._reset()
        if len(self._parts) >= PARTS_CACHE:
            self._new_epoch()
        return out

