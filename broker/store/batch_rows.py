"""Runs: consecutive routed messages of one type and one session, stored as one row.

A busy publisher's received chunk is one routing batch (one Hat session)
of often thousands of messages of the same type.  Writing each as its own
indexed row costs the writer about as much CPU as routing it; writing the
run as one row (timestamps, delivery counts and frame offsets as packed
arrays, the frames concatenated) costs a fraction, and the indexes stay
exact: every event of a run has the run's type, and the run's first and
last events are its smallest and largest in (timestamp, session,
instance) order, because a run only grows while timestamps do not go back.

A run may also continue across sessions: independent publishers (one
message per write) make each message its own routing batch, hence its own
session, and a row per message cost SQLite about 14 us of the writer's CPU
per message (``python -m bench.store_row_cost``).  Consecutive events of
one type (in routing order, so in EventId order) therefore stay one run
whatever their sessions; such a run keeps its EventIds in ``ids`` (packed
session, instance pairs), and ``session``/``first`` still name its first
event, which every index on EventIds needs (a run's events only grow).  A
run within one session keeps ``ids`` NULL: its EventIds are (session,
first + i).

A message with a source timestamp is a run of its own (its source
timestamp is indexed), and runs are bounded in events, bytes and time span
(:data:`MAX_RUN`, :data:`MAX_RUN_BYTES`, :data:`MAX_RUN_SPAN`) so reading
one for a query or a replay page stays cheap.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from itertools import repeat
from operator import attrgetter, contains
from typing import TYPE_CHECKING, Protocol

from broker.core.events import SOURCE_TIMESTAMP_TAG
from broker.core.retention import Entry
from wire.skan.codec import PURE_PYTHON

if TYPE_CHECKING:
    from broker.core.router import Routed

# Events in one run: bounds the work of decoding a run that a query needs
# only a few events of.
MAX_RUN = 4096
# Frame bytes in one run (one message may exceed it and is a run alone).
MAX_RUN_BYTES = 1 << 20
# Seconds between a run's first and last timestamps: a query for events
# after time t need only look at runs that began after t - MAX_RUN_SPAN.
MAX_RUN_SPAN = 1.0

_SWAP = sys.byteorder != "little"  # arrays are stored little-endian


def pack(kind: str, values: list) -> bytes:
    a = array(kind, values)
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def unpack(kind: str, data: bytes) -> array:
    a = array(kind)
    a.frombytes(data)
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a


_header = attrgetter("header")


def message_row_py(routed: Routed, src: int | None = None) -> tuple:
    """One message as a run of its own: the 13 columns of :func:`batch_row`'s row,
    with ``src`` (source timestamp, µs) as ``src_us``."""
    frame, ts = routed.frame, routed.timestamp
    size = len(frame)
    header = routed.header
    return (routed.session, routed.instance, routed.instance, header[b"group"],
            header[b"instance"], ts, ts, src, size, pack("d", [ts]),
            pack("q", [routed.delivered]), pack("q", [0, size]), frame)


def batch_row_py(batch: list[Routed]) -> tuple | None:
    """The row of a routing batch that is one run, or None when it is not.

    A publisher's received chunk is one batch: one session, consecutive
    instances, usually one type throughout.  The reference states it with
    the one rule of what continues a run, :func:`merge_rows_py`: the batch
    is one run when its messages, each a row of its own, merge into one row
    whose EventIds are consecutive instances of one session.  A message with
    a source timestamp makes it None (such a message is a run alone), as
    does anything else the merge stops at (several types, a clock that went
    back, a bound exceeded): the writer then merges the batch message by
    message.
    """
    if any(map(contains, map(_header, batch), repeat(SOURCE_TIMESTAMP_TAG))):
        return None
    ops = [(0, message_row_py(routed)) for routed in batch]
    # The bounds are read now (the differential tests lower them).
    end, row, _ = merge_rows_py(ops, 0, len(ops), 0, MAX_RUN, MAX_RUN_BYTES, MAX_RUN_SPAN)
    if end < len(ops) or row[13] is not None:
        return None
    return row[:13]


# broker/_observer_speedups.c computes the same row in one C loop (no Python code and
# no temporary lists per message); batch_row_py above is the reference and
# the fallback (SKAN_PURE_PYTHON=1, no compiler, or an argument the C code
# leaves to it by returning NotImplemented).
BATCH_ROW_IMPLEMENTATION = "python"
_batch_row_c = None
if not PURE_PYTHON:
    try:
        from broker._observer_speedups import batch_row as _batch_row_c
    except ImportError:  # pragma: no cover - built without a compiler
        _batch_row_c = None
    else:
        BATCH_ROW_IMPLEMENTATION = "c"
_merge_rows_c = None
if _batch_row_c is not None:
    try:
        from broker._observer_speedups import merge_rows as _merge_rows_c
    except ImportError:  # pragma: no cover - an extension built before merge_rows
        _merge_rows_c = None


# The store's open run (broker/_observer_speedups.c, RunBuilder): the routing
# thread appends each batch that is one run and continues it, the writer
# takes it whole once a flush.  None without the extension: the store then
# queues each batch's row (batch_row) and the writer merges them
# (merge_rows), which is the reference the builder is held to.
RunBuilder: type | None = None
if _merge_rows_c is not None:
    try:
        from broker._observer_speedups import RunBuilder
    except ImportError:  # pragma: no cover - an extension built before RunBuilder
        RunBuilder = None


class OpenRun(Protocol):
    """What the store asks of a RunBuilder (see broker/_observer_speedups.c)."""

    nbytes: int  # frame bytes appended
    events: int
    sealed: bool

    def add(self, batch: list[Routed]) -> int | None:
        """Frame bytes appended (>= 0); -1: one run, but not this one's (or
        sealed); None: not one run; NotImplemented: the reference answers."""

    def seal(self) -> None: ...

    def take(self) -> tuple | None: ...


def new_run(run_kind: int) -> OpenRun:
    """An open run whose take() returns ``(run_kind, row, ...)`` (the bounds are read
    now: the differential tests lower them)."""
    assert RunBuilder is not None
    return RunBuilder(SOURCE_TIMESTAMP_TAG, run_kind, MAX_RUN, MAX_RUN_BYTES, MAX_RUN_SPAN)


def batch_row(batch: list[Routed]) -> tuple | None:
    """The row of a routing batch that is one run, or None (see :func:`batch_row_py`)."""
    if _batch_row_c is not None:
        row = _batch_row_c(batch, SOURCE_TIMESTAMP_TAG, MAX_RUN, MAX_RUN_BYTES, MAX_RUN_SPAN)
        if row is not NotImplemented:
            return row
    return batch_row_py(batch)


def message_row(routed: Routed) -> tuple:
    """One message without a source timestamp as a row (:func:`message_row_py`),
    built in C where the extension is."""
    if _batch_row_c is not None:
        row = _batch_row_c([routed], SOURCE_TIMESTAMP_TAG, MAX_RUN, MAX_RUN_BYTES,
                           MAX_RUN_SPAN)
        if row is not NotImplemented and row is not None:
            return row
    return message_row_py(routed)


def merge_rows_py(ops: list, start: int, end: int, row_kind: int,
                  max_run: int = MAX_RUN, max_bytes: int = MAX_RUN_BYTES,
                  max_span: float = MAX_RUN_SPAN) -> tuple[int, tuple, int]:
    """Consecutive batch rows of one type merged into one run: ``(j, row, events)``.

    ``ops[start]`` is a queued row (``(row_kind, row, ...)``, ``row`` from
    :func:`batch_row`); the rows after it up to ``end`` join it while they
    are rows too, of the same type, timestamps do not go back, and the run
    stays within the bounds.  ``ops[start:j]`` are merged: ``row`` is the
    run's 14 columns (``ids`` packed when its events are not consecutive
    instances of one session), ``events`` how many it holds.  Independent
    publishers' messages (one routing batch, so one row, each) thereby
    become a run per flush without Python code per message in the writer.
    """
    first_row = ops[start][1]
    session, first, last, grp, inst, min_ts, max_ts = first_row[:7]
    n = last - first + 1
    nbytes = first_row[8]
    last_session = session
    contiguous = True
    j = start + 1
    while j < end:
        op = ops[j]
        if type(op) is not tuple or op[0] != row_kind:
            break
        r = op[1]
        rn = r[2] - r[1] + 1
        if not (r[3] == grp and r[4] == inst and r[5] >= max_ts and r[6] - min_ts <= max_span
                and n + rn <= max_run and nbytes + r[8] <= max_bytes
                and (r[0], r[1]) > (last_session, last)):
            break
        if r[0] != last_session or r[1] != last + 1:
            contiguous = False
        last_session, last, max_ts = r[0], r[2], r[6]
        n += rn
        nbytes += r[8]
        j += 1
    if j == start + 1:
        return j, (*first_row, None), n
    rows = [op[1] for op in ops[start:j]]
    offsets = [0]
    base = 0
    for r in rows:
        offsets += [base + o for o in unpack("q", r[11])[1:]]
        base += r[8]
    ids = None
    if not contiguous:
        pairs: list[int] = []
        for r in rows:
            for i in range(r[1], r[2] + 1):
                pairs += (r[0], i)
        ids = pack("q", pairs)
    return j, (session, first, last, grp, inst, min_ts, max_ts, None, nbytes,
               b"".join([r[9] for r in rows]), b"".join([r[10] for r in rows]),
               pack("q", offsets), b"".join([r[12] for r in rows]), ids), n


def merge_rows(ops: list, start: int, end: int, row_kind: int) -> tuple[int, tuple, int]:
    """Consecutive queued rows as one run (see :func:`merge_rows_py`)."""
    if _merge_rows_c is not None:
        merged = _merge_rows_c(ops, start, end, row_kind, MAX_RUN, MAX_RUN_BYTES, MAX_RUN_SPAN)
        if merged is not NotImplemented:
            return merged
    return merge_rows_py(ops, start, end, row_kind)


# Columns a reader selects to decode a run (see decode()).
RUN_COLUMNS = "session, first, last, grp, inst, ts, delivered, offsets, frames, src_us, ids"
# How many of a row's leading columns decode() reads (RUN_COLUMNS).
RUN_WIDTH = 11


def run_ids(session: int, first: int, last: int, ids_b: bytes | None) -> list[tuple[int, int]]:
    """A run's EventIds, oldest first."""
    if ids_b is None:
        return [(session, i) for i in range(first, last + 1)]
    ids = unpack("q", ids_b)
    return list(zip(ids[::2], ids[1::2], strict=True))


def decode(row: tuple, after: tuple[int, int] | None = None, reverse: bool = False
           ) -> Iterator[tuple[Entry, int | None]]:
    """(entry, source µs) of a run's events after EventId ``after``, in order or reversed."""
    session, first, last, grp, inst, ts_b, delivered_b, offsets_b, frames, src, ids_b = row
    ts = unpack("d", ts_b)
    delivered = unpack("q", delivered_b)
    offsets = unpack("q", offsets_b)
    if ids_b is not None:
        ids = run_ids(session, first, last, ids_b)
        start = 0 if after is None else bisect_right(ids, after)
        indexes = range(len(ids) - 1, start - 1, -1) if reverse else range(start, len(ids))
        for i in indexes:
            s, n = ids[i]
            yield (s, n, ts[i], frames[offsets[i]:offsets[i + 1]], delivered[i], grp, inst), src
        return
    start = 0
    if after is not None:
        if after[0] > session or (after[0] == session and after[1] >= last):
            return
        if after[0] == session and after[1] >= first:
            start = after[1] - first + 1
    indexes = range(last - first, start - 1, -1) if reverse else range(start, last - first + 1)
    for i in indexes:
        yield (session, first + i, ts[i], frames[offsets[i]:offsets[i + 1]], delivered[i], grp,
               inst), src
