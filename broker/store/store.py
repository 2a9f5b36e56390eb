"""The durable store: retained messages, bridge spools and resume points (docs/store.md).

Two jobs, two classes: :class:`broker.store.writer.StoreWriter` queues what
routing hands over and commits it behind, in its own thread;
:class:`broker.store.reader.StoreReader` answers queries, Mariner replay
and the bridges' start-up from the committed store.  :class:`Store` is the
writer with its reader attached: what the rest of the broker holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from broker.core.retention import Entry
from broker.core.router import Routed
from broker.store.reader import StoreReader
from broker.store.writer import (
    LOG_INTERVAL,
    MAX_PENDING_BYTES,
    SESSION_LEASE,
    StoreStats,
    StoreWriter,
    default_dir,
)

__all__ = ["LOG_INTERVAL", "MAX_PENDING_BYTES", "SESSION_LEASE", "Store", "StoreStats",
           "default_dir"]


class Store(StoreWriter):
    """The writer (queue, thread, commits, eviction) and its reader (queries)."""

    def __init__(self, directory: str, *, size: int, max_bytes: int, max_age: float,
                 flush_interval: float, spool_max_bytes: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(directory, size=size, max_bytes=max_bytes, max_age=max_age,
                         flush_interval=flush_interval, spool_max_bytes=spool_max_bytes,
                         clock=clock)
        try:
            self.reader = StoreReader(self.path, self.flush, lambda: self.evicted_upto)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        """Commit everything queued, stop the writer, checkpoint and close both connections."""
        super().close()
        self.reader.close()

    # ---- reads (StoreReader) -------------------------------------------------------

    def newest(self) -> Routed | None:
        return self.reader.newest()

    def entries_after(self, session: int, instance: int, limit: int | None = None
                      ) -> list[Entry]:
        return self.reader.entries_after(session, instance, limit)

    def after(self, session: int, instance: int, limit: int | None = None) -> Iterator[Routed]:
        return self.reader.after(session, instance, limit)

    def entry(self, session: int, instance: int) -> tuple[Entry, int | None] | None:
        return self.reader.entry(session, instance)

    def latest_entries(self, groups: list[bytes] | None) -> list[Entry]:
        return self.reader.latest_entries(groups)

    def ordered(self, **query) -> Iterator[tuple[Entry, int | None]]:
        """See :meth:`StoreReader.ordered`."""
        return self.reader.ordered(**query)

    def spooled(self, bridge: str) -> list[Routed]:
        return self.reader.spooled(bridge)

    def resume_point(self, bridge: str) -> tuple[int, int, int] | None:
        return self.reader.resume_point(bridge)

    def _wanted_types(self, group: bytes, accept_type: Callable[[bytes, bytes], bool]
                      ) -> list[bytes] | None:
        return self.reader._wanted_types(group, accept_type)
