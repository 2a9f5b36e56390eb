"""Bounded retention store of routed messages (Eventer queries, Mariner replay).

Every routed message is retained, delivered or not, in routing order, which
is also EventId order (sessions and instances only increase).  The store is
a ring: when full, the oldest message goes.  Pure; registered as a router
observer.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from broker.router import Routed, Router


class RetentionStore:
    def __init__(self, size: int) -> None:
        # size 0 disables retention (queries and replay then see nothing).
        self.size = size
        self._items: deque[Routed] = deque(maxlen=size or 1)
        self.evicted = 0

    def attach(self, router: Router) -> None:
        if self.size:
            router.observers.append(self.add)

    def add(self, routed: Routed) -> None:
        items = self._items
        if len(items) == items.maxlen:
            self.evicted += 1
        items.append(routed)

    def __len__(self) -> int:
        return len(self._items) if self.size else 0

    def __iter__(self) -> Iterator[Routed]:
        return iter(self._items) if self.size else iter(())

    def after(self, session: int, instance: int) -> Iterator[Routed]:
        """Messages strictly after EventId (session, instance), oldest first."""
        items = self._items
        if not self.size or not items:
            return iter(())
        key = (session, instance)
        # deque supports indexing; bisect over it with a key (O(log n) lookups,
        # each O(1) near the ends of the deque).
        i = bisect.bisect_right(items, key, key=lambda r: (r.session, r.instance))
        return (items[j] for j in range(i, len(items)))

    def newest_first(self) -> Iterator[Routed]:
        return reversed(self._items) if self.size else iter(())
