"""The routing log: a router observer feeding a writer thread through a bounded queue.

Routing path (trio thread): the observer appends each routed message's
record to a buffer, compiled: ``format = "parquet"`` (the default) to
column buffers (:class:`.columns.ColumnBuffer`), ``"jsonl"`` as a JSON line
(:class:`.record.RecordBuffer`).  Every ``handoff_size`` records (and on a
short timer, see :mod:`broker.observability.routelog.routelog_service`) the buffer
goes to the writer thread as one batch: the writer is woken per batch,
never per message.

Writer thread, Parquet: keeps the batches as they come and every
:data:`.parquet.ROW_GROUP_ROWS` records makes them one Arrow table (their
buffers as they are) and encodes a row group (:mod:`.parquet`: pyarrow's
C++), appends its bytes to the hidden file,
rotates by size and by age, and publishes finished files atomically
(:mod:`.files`).  JSON Lines: joins a batch and writes it with one
``os.write``.

When more than ``queue_records`` records wait for the writer (a disk that
fails or cannot keep up), ``when_full`` decides: ``"drop"`` (the default)
drops each further hand-off batch, counted in ``dropped`` and logged, and
routing goes on; ``"backpressure"`` calls ``close_gate`` (the service closes
the connections' admission gate, so no connection reads more input) until
the writer has brought the backlog down to half the bound and calls
``request_open`` (thread-safe).  On a disk error the writer retries the same
step with capped backoff; what it holds is never dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from broker.core.backoff import Backoff
from broker.core.router import Router
from broker.core.tally import counter
from broker.observability.routelog.columns import ColumnBuffer, Columns, parts_only
from broker.observability.routelog.files import LogDirectory, LogFile, Recovery
from broker.observability.routelog.record import RecordBuffer

log = logging.getLogger(__name__)

FORMATS = ("parquet", "jsonl")
WHEN_FULL = ("drop", "backpressure")

# Records per hand-off batch: big enough that queue and write overheads
# vanish per record (one os.write of ~1 MB), small enough that a batch is
# formatted in a few milliseconds and the thread yields the GIL often.
MAX_HANDOFF = 4096
# Disk-error retry backoff (seconds): first wait and cap.
RETRY_FIRST = 0.05
RETRY_MAX = 5.0
# After a stop was requested a broken disk may not hold the broker forever:
# give up (loudly, counting what is lost) after this many seconds of errors.
STOP_RETRY_SECONDS = 30.0
# Seconds between two log lines about dropped records (when_full = "drop").
DROP_LOG_INTERVAL = 10.0

_STOP = None


def _noop() -> None:
    pass


@attrs.define
class RoutelogStats:
    """The routing log's counters: ints updated by one thread each (``handed``
    and ``dropped`` the trio thread, the rest the writer), read anywhere; the
    metrics export each declared one (broker/core/tally.py)."""

    records: int = counter("skan_routelog_records",
                           "Routing-log records taken by the writer into its files.")
    files: int = counter("skan_routelog_files", "Routing-log files completed (fsynced, renamed).")
    dropped: int = counter(
        "skan_routelog_dropped_records",
        "Routing-log records dropped because [log] queue_records were waiting "
        "(when_full = \"drop\").")
    backpressure_closes: int = counter(
        "skan_routelog_backpressure_closes",
        "Times the routing log closed its admission gate (backlog over [log] queue_records).")
    errors: int = counter("skan_routelog_errors",
                          "Routing-log disk operations that failed and were retried.")
    lost: int = counter("skan_routelog_lost_records",
                        "Routing-log records given up at stop because the disk kept failing.")
    # Retention: complete files (and their bytes) removed as too old or over max_bytes.
    pruned_files: int = counter(
        "skan_routelog_pruned_files",
        "Complete routing-log files removed by retention ([log] max_bytes, max_age), "
        "oldest first.")
    pruned_bytes: int = counter("skan_routelog_pruned_bytes",
                                "Bytes of routing-log files removed by retention.")
    # Records given to the writer (the backlog is handed - records - lost).
    handed: int = 0


class RoutingLog:
    """Writes one record per routed message; exposes the counters metrics export.

    ``records``: records the writer has taken into its files (a Parquet
    file's records reach the disk with their row group and become visible
    when the file is published); ``files``: files completed (fsynced and
    published); ``queued``: records accepted but not yet taken by the
    writer; ``lag_seconds``: the age of the oldest of them;
    ``dropped``: records dropped because the queue was full
    (``when_full = "drop"``); ``backpressure_waits``: reads that waited on
    the closed admission gate (set by the service); ``backpressure_closes``:
    times the gate was closed; ``errors``: disk operations that failed and
    were retried; ``lost``: records given up at stop after the disk failed
    for ``STOP_RETRY_SECONDS``; ``pruned_files`` / ``pruned_bytes``: complete
    files removed by retention (``max_bytes`` / ``max_age``, oldest first).
    """

    def __init__(
        self,
        directory: LogDirectory,
        *,
        rotate_bytes: int,
        rotate_seconds: float,
        queue_records: int,
        max_bytes: int = 0,
        max_age: float = 0.0,
        format: str = "parquet",
        when_full: str = "drop",
        close_gate: Callable[[], None] = _noop,
        request_open: Callable[[], None] = _noop,
        thread_setup: Callable[[], object] = _noop,
    ) -> None:
        if format not in FORMATS or when_full not in WHEN_FULL:
            raise ValueError(f"format {format!r} / when_full {when_full!r}")
        if format == "parquet":
            # pyarrow now, not at the first hand-off: its import (~0.5 s, ~75 MiB
            # of libraries) would hold the GIL while routing runs.  The module
            # also imports pyarrow.compute, which pyarrow itself would import
            # at the first Array.take.
            from broker.observability.routelog import parquet  # noqa: F401
        self.directory = directory
        self.format = format
        self.when_full = when_full
        directory.suffix = "." + format
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.queue_records = queue_records
        # Retention: complete files beyond these (oldest first) are removed; 0 = no limit.
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.low_water = queue_records // 2
        self.handoff_size = max(1, min(MAX_HANDOFF, queue_records // 4))
        self._close_gate = close_gate
        self._request_open = request_open
        # Runs first in the writer thread (its scheduler priority).
        self._thread_setup = thread_setup
        self.recovery = Recovery()
        self.stats = RoutelogStats()
        self.gate_closed = False
        # Set when the writer thread died of an unexpected exception.
        self.failure: BaseException | None = None
        self.waits_source: Callable[[], int] = lambda: 0
        # The writer thread's scheduling (broker/serving/scheduling.py,
        # Background; set by the service): idle while it keeps up, at its
        # nice value once a quarter of queue_records waits.
        self.background: Any = None
        self.buffer: RecordBuffer | ColumnBuffer | None = None
        self._queue: queue.SimpleQueue[list[str] | Columns | None] = queue.SimpleQueue()
        # Trio thread: (handed count after a batch, time.time() its first record
        # was routed) of each batch the writer may not have taken yet (lag_seconds).
        self._batches: deque[tuple[int, float]] = deque()
        self._last_drop_log = -DROP_LOG_INTERVAL
        self._file: LogFile | None = None
        # Parquet: the open file's encoder and its next row group: tables
        # converted, then hand-off batches as they came (their seq bytes).
        self._encoder: Any = None
        self._rows: list[Any] = []
        self._pending: list[Columns] = []
        self._pending_seq = 0
        self._row_count = 0
        self._parts_table: Any = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="routelog-writer", daemon=True)

    # ---- trio thread ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def attach(self, router: Router) -> None:
        """Register the observer: it never blocks and never fails."""
        kind = ColumnBuffer if self.format == "parquet" else RecordBuffer
        self.buffer = kind(self.handoff_size, self.handoff, router)
        router.observers.append(self.buffer.observe)

    def handoff(self) -> None:
        """Give the buffered lines to the writer; past the bound drop them or close the gate."""
        if self.buffer is None or not self.buffer.pending():
            return
        first_at = self.buffer.first_at
        pending = self.buffer.take()
        count = pending.rows if isinstance(pending, Columns) else len(pending)
        backlog = self.stats.handed - self.stats.records - self.stats.lost
        background = self.background
        if backlog > self.queue_records // 4 and background is not None and background.idle:
            background.behind()  # a starved idle writer gets its share back
        if backlog > self.queue_records and self.when_full == "drop":
            self.stats.dropped += count
            if isinstance(pending, Columns) and pending.new_parts:
                self._queue.put(parts_only(pending))  # later keys may name these parts
            now = time.monotonic()
            if now - self._last_drop_log >= DROP_LOG_INTERVAL:
                self._last_drop_log = now
                log.error("routing log: %d records wait for the disk (queue_records %d): "
                          "dropping new records, %d dropped so far (when_full = \"drop\")",
                          backlog, self.queue_records, self.stats.dropped)
            return
        self.stats.handed += count
        self._batches.append((self.stats.handed, first_at))
        self._forget_written()
        self._queue.put(pending)
        if (not self.gate_closed and self.when_full == "backpressure"
                and self.stats.handed - self.stats.records > self.queue_records):
            self.gate_closed = True
            self.stats.backpressure_closes += 1
            self._close_gate()

    def _forget_written(self) -> None:
        batches, done = self._batches, self.stats.records + self.stats.lost
        while batches and batches[0][0] <= done:
            batches.popleft()

    def reopen_if_drained(self) -> bool:
        """Trio thread: reopen the gate when the backlog is down to the low-water mark."""
        if self.gate_closed and self.stats.handed - self.stats.records <= self.low_water:
            self.gate_closed = False
            return True
        return False

    def stop(self) -> None:
        """Hand off everything and ask the writer to finish its file and exit."""
        self.handoff()
        self._stopping = True
        self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        self.directory.close()

    @property
    def queued(self) -> int:
        pending = self.buffer.pending() if self.buffer is not None else 0
        return self.stats.handed + pending - self.stats.records - self.stats.lost

    @property
    def lag_seconds(self) -> float:
        """Trio thread: the age of the oldest record the writer has not taken (else 0)."""
        self._forget_written()
        if self._batches:
            oldest = self._batches[0][1]
        elif self.buffer is not None and self.buffer.pending():
            oldest = self.buffer.first_at
        else:
            return 0.0
        return max(0.0, time.time() - oldest)

    @property
    def backpressure_waits(self) -> int:
        return self.waits_source()

    # ---- writer thread ----------------------------------------------------

    def _run(self) -> None:
        self._thread_setup()
        try:
            self._prune()
            while True:
                f = self._file
                timeout = None
                if f is not None:
                    timeout = max(0.0, f.opened + self.rotate_seconds - time.monotonic())
                try:
                    batch = self._queue.get(timeout=timeout)
                except queue.Empty:
                    batch = []
                if batch is _STOP:
                    break
                if batch:
                    if self.format == "parquet":
                        self._take_rows(batch)
                    else:
                        self._write(batch)
                f = self._file
                if f is not None and time.monotonic() - f.opened >= self.rotate_seconds:
                    self._finish()
                if self.gate_closed and self.stats.handed - self.stats.records <= self.low_water:
                    self._request_open()
                background = self.background
                if (background is not None and not background.idle
                        and self.stats.handed - self.stats.records < self.queue_records // 16):
                    background.caught_up()
            if self._file is not None:
                self._finish()
        except _GiveUp:
            pass
        except BaseException as exc:
            # A bug, not a disk error: the service sees it and stops the broker.
            log.exception("routing log writer failed")
            self.failure = exc

    def _take_rows(self, batch: Columns) -> None:
        """Parquet: a batch joins the next row group (converted and written once it is full).

        The batch is kept as the routing thread made it; the row group's
        batches become one Arrow table when it is due (:meth:`_convert`),
        so the writer runs Python and takes the interpreter once a row
        group, not once a hand-off (20 a second under light traffic, each
        a window in which routing waited for the interpreter: the isolated
        tail, docs/performance.md).
        """
        from broker.observability.routelog.columns import MAX_SEQ_BYTES
        from broker.observability.routelog.parquet import ROW_GROUP_ROWS

        pending = self._pending
        if pending and (batch.epoch != pending[0].epoch
                        or self._pending_seq + len(batch.seq_data) > MAX_SEQ_BYTES):
            self._convert()  # a table per epoch; seq offsets within int32
        self._pending.append(batch)
        self._pending_seq += len(batch.seq_data)
        if not batch.rows:
            return  # the parts of a dropped batch: later keys may name them
        if self._file is None:
            self._open()
        self._row_count += batch.rows
        self._file.records += batch.rows
        self.stats.records += batch.rows
        if self._row_count >= ROW_GROUP_ROWS:
            self._write_row_group()
            f = self._file
            if f is not None and f.size >= self.rotate_bytes:
                self._finish()

    def _convert(self) -> None:
        """The pending batches (one epoch) as one Arrow table of the next row group."""
        from broker.observability.routelog.parquet import PartsTable, columns_to_table

        if not self._pending:
            return
        if self._parts_table is None:
            self._parts_table = PartsTable()
        table = columns_to_table(self._pending, self._parts_table)
        self._pending, self._pending_seq = [], 0
        if table.num_rows:
            self._rows.append(table)

    def _open(self) -> LogFile:
        f = self._file = self._retry(self.directory.new_file, "open a log file")
        if self.format == "parquet":
            from broker.observability.routelog.parquet import ParquetEncoder

            self._encoder = ParquetEncoder()
        return f

    def _write_row_group(self) -> None:
        self._convert()
        if self._rows:
            data = self._encoder.row_group(self._rows)
            self._rows, self._row_count = [], 0
            self._append(data)

    def _append(self, data: bytes) -> None:
        f = self._file
        assert f is not None
        try:
            f.write(data)
        except OSError as exc:
            self._retry(f.drain, f"write {f.name}", exc)

    def _write(self, batch: list[str]) -> None:
        """JSON Lines: one batch of lines into the file(s), whole lines per file."""
        data = memoryview("".join(batch).encode())
        whole = True  # the batch went into one file: its line count is len(batch)
        while data:
            f = self._file
            if f is None:
                f = self._open()
            room = self.rotate_bytes - f.size
            if len(data) <= room:
                chunk, data = data, data[len(data):]
            else:
                # Fill this file up to the last whole line that fits, then rotate.
                cut = bytes(data[:room]).rfind(b"\n") + 1
                whole = False
                if cut == 0 and f.size:
                    self._finish()
                    continue
                if cut == 0:  # one line longer than rotate_bytes: a file of its own
                    cut = bytes(data).find(b"\n") + 1
                chunk, data = data[:cut], data[cut:]
            self._append(chunk)
            n = len(batch) if whole else bytes(chunk).count(b"\n")
            f.records += n
            self.stats.records += n
            if f.size >= self.rotate_bytes:
                self._finish()

    def _finish(self) -> None:
        f = self._file
        assert f is not None
        if self._encoder is not None:
            self._write_row_group()
            self._append(self._encoder.finish())
            self._encoder = None
        self._retry(f.finish, f"finish {f.name}")
        self._file = None
        self.stats.files += 1
        self._prune()

    def _prune(self) -> None:
        """Apply retention; a failure is logged and retried at the next finished file."""
        try:
            pruned = self.directory.prune(self.max_bytes, self.max_age)
        except OSError as exc:
            self.stats.errors += 1
            log.error("routing log: retention pass failed: %s", exc)
            return
        if pruned.files:
            self.stats.pruned_files += pruned.files
            self.stats.pruned_bytes += pruned.bytes
            log.info("routing log: removed %d old file(s), %d bytes (retention: max_bytes=%d, "
                     "max_age=%gs)", pruned.files, pruned.bytes, self.max_bytes, self.max_age)

    def _retry(self, step: Callable[[], Any], what: str, first: OSError | None = None) -> Any:
        """Run ``step`` until it succeeds; ``first`` is the error of an attempt already made.

        Disk errors (full, quota, I/O) are retried with capped backoff; the
        records stay queued meanwhile and back-pressure holds routing back.
        """
        backoff = Backoff(RETRY_FIRST, RETRY_MAX)
        failing_since: float | None = None
        error = first
        while True:
            if error is None:
                try:
                    result = step()
                except OSError as exc:
                    error = exc
                else:
                    if failing_since is not None:
                        log.warning("routing log: %s succeeded after %.1f s", what,
                                    time.monotonic() - failing_since)
                    return result
            self.stats.errors += 1
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                log.error("routing log: cannot %s: %s; retrying (input is held back once "
                          "the queue is full)", what, error)
            if self._stopping and now - failing_since > STOP_RETRY_SECONDS:
                lost = self.stats.handed - self.stats.records
                self.stats.lost += lost
                log.error("routing log: giving up at stop after %.0f s of errors; "
                          "%d record(s) not written", now - failing_since, lost)
                if self._file is not None:
                    self._file.abandon()
                raise _GiveUp from error
            error = None
            time.sleep(backoff.wait())


class _GiveUp(Exception):
    pass
