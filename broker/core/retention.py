"""Bounded retention store of routed messages (Eventer queries, Mariner replay).

Every routed message is retained, delivered or not, in routing order, which
is also EventId order (sessions and instances only increase).  The store is
a ring: when full, the oldest message goes.  Pure; registered as a router
observer.

Entries are plain tuples of atoms ``(session, instance, timestamp, frame,
delivered, group, instance_name)``: CPython's collector stops tracking such tuples, so a full store
of 100,000 messages adds nothing to garbage-collection pauses (holding the
``Routed`` objects themselves made a full collection take ~20 ms, visible in
p99 latency).  Readers get ``Routed`` views rebuilt on demand; readers that
filter by group/instance (Eventer queries) can scan the raw entries with
:meth:`RetentionStore.entries` and decode only what they keep (:func:`view`):
the routing header is not decoded again for the messages they skip.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from broker.core.router import Endpoint, Routed, Router
from wire.skan import decode_header

Entry = tuple[int, int, float, bytes, int, bytes, bytes]

# Positions in an Entry.
SESSION, INSTANCE, TIMESTAMP, FRAME, DELIVERED, GROUP, INSTANCE_NAME = range(7)


class _Retired(Endpoint):
    """Stands in for the sender of a retained message (see the header's 'from')."""

    def deliver(self, frame: bytes, routed: Routed) -> None:  # pragma: no cover
        raise RuntimeError("a retained message's sender cannot receive")


RETIRED = _Retired()


def view(entry: Entry) -> Routed:
    """The ``Routed`` view of a raw entry (decodes the routing header)."""
    session, instance, timestamp, frame, delivered = entry[:5]
    return Routed(frame, decode_header(frame, 4), RETIRED, (), delivered, session, instance,
                  timestamp)


class RetentionStore:
    """The in-memory ring (``[store] enabled = false``; the store's reference in tests).

    Bounded by ``size`` messages, ``max_bytes`` frame bytes (0: no byte bound)
    and ``max_age`` seconds (0: no age bound, measured against the newest
    message's timestamp); oldest first, every eviction counted.
    """

    def __init__(self, size: int, max_bytes: int = 0, max_age: float = 0.0) -> None:
        # size 0 disables retention (queries and replay then see nothing).
        self.size = size
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._items: deque[Entry] = deque()
        self.bytes = 0
        self.evicted = 0
        # (session, instance) of the newest evicted message: a replay that
        # starts before it has lost messages to the ring (a visible gap).
        self.evicted_upto: tuple[int, int] | None = None

    def attach(self, router: Router) -> None:
        if self.size:
            router.local_observers.append(self.observe)

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: keep the batch's messages, evicting past the bounds."""
        for routed in batch:
            self.add(routed)

    def add(self, routed: Routed) -> None:
        items = self._items
        header = routed.header
        frame = routed.frame
        items.append((routed.session, routed.instance, routed.timestamp, frame,
                      routed.delivered, header[b"group"], header[b"instance"]))
        self.bytes += len(frame)
        max_bytes = self.max_bytes
        cutoff = routed.timestamp - self.max_age if self.max_age else None
        while items and (len(items) > self.size or (max_bytes and self.bytes > max_bytes)
                         or (cutoff is not None and items[0][TIMESTAMP] < cutoff)):
            gone = items.popleft()
            self.bytes -= len(gone[FRAME])
            self.evicted += 1
            self.evicted_upto = (gone[0], gone[1])

    def __len__(self) -> int:
        return len(self._items) if self.size else 0

    def __iter__(self) -> Iterator[Routed]:
        return map(view, list(self._items)) if self.size else iter(())

    def after(self, session: int, instance: int, limit: int | None = None) -> Iterator[Routed]:
        """Messages strictly after EventId (session, instance), oldest first (at most ``limit``)."""
        return map(view, self.entries_after(session, instance, limit))

    def entries(self, newest_first: bool = False) -> list[Entry]:
        """A snapshot of the raw entries, oldest first (or newest first)."""
        if not self.size:
            return []
        return list(reversed(self._items)) if newest_first else list(self._items)

    def entries_after(self, session: int, instance: int, limit: int | None = None
                      ) -> list[Entry]:
        """Raw entries strictly after EventId (session, instance), oldest first (``limit``)."""
        items = self._items
        if not self.size or not items:
            return []
        # deque indexing is O(1) near the ends and O(n/64) in the middle:
        # bisect makes O(log n) such lookups.
        i = bisect.bisect_right(items, (session, instance), key=lambda e: (e[0], e[1]))
        stop = len(items) if limit is None else min(len(items), i + limit)
        return [items[j] for j in range(i, stop)]

    def newest(self) -> Routed | None:
        return view(self._items[-1]) if self.size and self._items else None

    def newest_first(self) -> Iterator[Routed]:
        return map(view, list(reversed(self._items))) if self.size else iter(())
