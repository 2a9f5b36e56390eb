"""The routing-log directory: file names, the owner lock, crash recovery, atomic files.

Plain blocking file I/O, run only in the writer thread (and once at start-up).

A file is written under a hidden temporary name (``.NAME.tmp``), then
fsynced, renamed to ``NAME`` and the directory fsynced, so a reader that
lists the directory (a Spark file-stream source skips names starting with
``.`` or ``_``) only ever sees complete files.  A killed broker leaves its
current file hidden; the next broker on that directory keeps a JSON Lines
file's complete lines (truncating a torn last line) and publishes it under
its final name, and removes a Parquet file (unreadable without the footer
written at its end), counting it.

Both formats may share a directory (a broker switched from ``jsonl`` to
``parquet`` keeps its old files): retention and recovery treat both.

One broker owns a directory at a time: it holds an exclusive ``flock`` on
``.lock``, so a second broker pointed at the same directory is refused
rather than recovering (publishing) the first one's open file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

import attrs

from broker.core.tally import counter

log = logging.getLogger(__name__)

PREFIX = "routelog-"
PARQUET_SUFFIX = ".parquet"
JSONL_SUFFIX = ".jsonl"
SUFFIXES = (PARQUET_SUFFIX, JSONL_SUFFIX)
SUFFIX = PARQUET_SUFFIX  # what a broker writes by default ([log] format)
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
# Recovery reads a torn file's tail backwards in blocks of this size to find its last newline.
TAIL_BLOCK = 64 * 1024


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def final_name(server_id: int, opened: float, counter: int, suffix: str = SUFFIX) -> str:
    """``routelog-<server id>-<UTC open time>-<counter>.parquet``: unique, sorts by time."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(opened))
    micros = int(opened * 1_000_000) % 1_000_000
    return f"{PREFIX}{server_id}-{stamp}.{micros:06d}Z-{counter:06d}{suffix}"


def is_temp(name: str) -> bool:
    return name.startswith("." + PREFIX) and any(
        name.endswith(suffix + TMP_SUFFIX) for suffix in SUFFIXES)


class LogFile:
    """One log file being written under its hidden name.

    Writes are resumable: when ``os.write`` fails, what was not written stays
    in ``pending`` and :meth:`drain` continues from there, so a retry after a
    transient error (disk full) never duplicates or skips bytes.
    """

    def __init__(self, directory: str, name: str) -> None:
        self.directory = directory
        self.name = name
        self.temp_path = os.path.join(directory, "." + name + TMP_SUFFIX)
        self.path = os.path.join(directory, name)
        # Read-write: if the file is removed under us, its data is read back (see finish).
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = os.open(self.temp_path, flags, 0o644)
        except FileNotFoundError:
            # The directory was removed while the broker runs: make it again.
            os.makedirs(directory, exist_ok=True)
            self.fd = os.open(self.temp_path, flags, 0o644)
        self.renamed = False
        self.opened = time.monotonic()
        self.size = 0
        self.records = 0
        self.pending = memoryview(b"")

    def write(self, data: bytes | memoryview) -> None:
        """Write ``data``; after an ``OSError`` call :meth:`drain` to resume."""
        assert not self.pending, "the previous write has not completed"
        self.pending = memoryview(data)
        self.drain()

    def drain(self) -> None:
        while self.pending:
            n = os.write(self.fd, self.pending)
            self.size += n
            self.pending = self.pending[n:]

    def finish(self) -> None:
        """fsync, rename to the final name, fsync the directory.  Retry-safe."""
        self.drain()
        os.fsync(self.fd)
        if not self.renamed:
            try:
                os.rename(self.temp_path, self.path)
            except FileNotFoundError:
                # The hidden file (or the whole directory) was removed under us; the
                # open descriptor still holds the data: copy it into a new file.
                self._rewrite_from_fd()
            self.renamed = True
        fsync_dir(self.directory)
        os.close(self.fd)
        self.fd = -1

    def _rewrite_from_fd(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.temp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            offset = 0
            while offset < self.size:
                chunk = os.pread(self.fd, min(1 << 20, self.size - offset), offset)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                offset += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self.temp_path, self.path)
        log.warning("routing log file %s was removed while open; rewrote it", self.name)

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def is_complete(name: str) -> bool:
    """A published log file (complete and fsynced), as opposed to the hidden one being written."""
    return name.startswith(PREFIX) and name.endswith(SUFFIXES)


@attrs.define
class Pruned:
    """What one retention pass removed."""

    files: int = 0
    bytes: int = 0


@attrs.define
class Recovery:
    """What start-up found of a previous broker's unfinished files (counted
    once, at open; exported so that records lost to a kill show on /metrics,
    not only in the start-up log)."""

    files: int = counter("skan_routelog_recovered_files",
                         "Unfinished routing-log files a previous broker left, published "
                         "at start-up up to their last complete line.")
    torn_bytes: int = counter("skan_routelog_recovered_torn_bytes",
                              "Bytes of torn last lines cut from those files at start-up.")
    removed_empty: int = counter("skan_routelog_recovered_empty_files",
                                 "Unfinished routing-log files with no complete line, removed "
                                 "at start-up.")
    # Parquet files a killed broker left without their footer (their records are lost).
    removed_unfinished: int = counter(
        "skan_routelog_recovered_unfinished_parquet_files",
        "Parquet files a previous broker left without their footer, removed at start-up "
        "(their records are lost).")


class LogDirectory:
    """The directory a broker writes its routing log into."""

    def __init__(self, path: str, server_id: int) -> None:
        self.path = path
        self.server_id = server_id
        # The suffix of the files this broker writes (its [log] format).
        self.suffix = SUFFIX
        self._counter = 0
        self._lock_fd = -1
        self._last_open = 0.0

    def open(self) -> Recovery:
        """Create the directory, take the owner lock, publish files a killed broker left.

        Raises ``OSError`` with a readable message when the directory cannot
        be used (not creatable, not writable, owned by another broker).
        """
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(os.path.join(self.path, LOCK_NAME),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"routing log directory {self.path!r}: {exc.strerror}") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OSError(
                    exc.errno,
                    f"routing log directory {self.path!r} is in use by another broker "
                    f"(it holds {LOCK_NAME}); give each broker its own [log] dir",
                ) from None
            raise
        self._lock_fd = fd
        return self.recover()

    def recover(self) -> Recovery:
        result = Recovery()
        for name in sorted(os.listdir(self.path)):
            if not is_temp(name):
                continue
            temp = os.path.join(self.path, name)
            if name.endswith(PARQUET_SUFFIX + TMP_SUFFIX):
                os.unlink(temp)
                result.removed_unfinished += 1
                continue
            kept, torn = _truncate_torn_tail(temp)
            result.torn_bytes += torn
            if kept == 0:
                os.unlink(temp)
                result.removed_empty += 1
                continue
            os.rename(temp, os.path.join(self.path, name[1 : -len(TMP_SUFFIX)]))
            result.files += 1
        if result.files or result.removed_empty or result.removed_unfinished:
            fsync_dir(self.path)
            log.warning(
                "routing log: published %d file(s) a previous broker left unfinished "
                "(%d torn bytes dropped, %d empty removed); removed %d unfinished Parquet "
                "file(s), whose records are lost",
                result.files, result.torn_bytes, result.removed_empty, result.removed_unfinished,
            )
        return result

    def new_file(self) -> LogFile:
        self._counter += 1
        # Names carry the open time; never let two files share one (clock steps back).
        now = max(time.time(), self._last_open + 1e-6)
        self._last_open = now
        return LogFile(self.path, final_name(self.server_id, now, self._counter, self.suffix))

    def prune(self, max_bytes: int, max_age: float, now: float | None = None) -> Pruned:
        """Remove the oldest complete files until the rest fit ``max_bytes`` and ``max_age``.

        Only published files count and only they are removed (never the hidden
        file being written); names sort by open time, so oldest go first.  A
        file's age is that of its last write (mtime).  0 disables a limit.
        Files another process removed meanwhile are skipped.
        """
        result = Pruned()
        if not max_bytes and not max_age:
            return result
        now = time.time() if now is None else now
        files: list[tuple[str, int, float]] = []
        for name in sorted(os.listdir(self.path)):
            if not is_complete(name):
                continue
            try:
                st = os.stat(os.path.join(self.path, name))
            except FileNotFoundError:
                continue
            files.append((name, st.st_size, st.st_mtime))
        total = sum(size for _, size, _ in files)
        for name, size, mtime in files:
            too_big = bool(max_bytes) and total > max_bytes
            too_old = bool(max_age) and now - mtime > max_age
            if not (too_big or too_old):
                break
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            else:
                result.files += 1
                result.bytes += size
            total -= size
        return result

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _truncate_torn_tail(path: str) -> tuple[int, int]:
    """Cut a file after its last newline and fsync it; returns (bytes kept, bytes cut)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - TAIL_BLOCK)
            block = os.pread(fd, end - start, start)
            i = block.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        if keep != size:
            os.ftruncate(fd, keep)
        os.fsync(fd)
        return keep, size - keep
    finally:
        os.close(fd)
