"""A bridge's view of the store: its spool of unacknowledged messages and its resume point.

A bridge is known in the store by its name (``protocol-index-address``, see
:func:`broker.serving.bridge_runner.bridge_name`), so its spool is found again
after a restart as long as its ``[[bridges]]`` entry keeps its place and
address.  Without a store (``[store] enabled = false``) every method does
nothing and the buffer lives in memory only.

The spool is bounded in frame bytes (``[store] spool_max_bytes``): a message
that would pass the bound pushes the oldest spooled messages out (NATS
JetStream's default ``discard = old``; the bridge's ``buffer`` count bound
drops the oldest too).  The newest message always stays, even alone above
the bound (as Mosquitto keeps a client's first queued message whatever
``max_queued_bytes`` says).  Every message pushed out is counted in the
store's ``spool_dropped``.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from broker.core.router import Routed
from broker.store.store import Store

EventId = tuple[int, int]


@attrs.define(eq=False)
class BridgeSpool:
    store: Store | None
    name: str
    # Frame size of every spooled message, oldest first (an OrderedDict
    # deletes in O(1) anywhere, acknowledgements come in any order, and pops
    # its oldest in O(1) where a dict would rescan the deleted front).
    sizes: OrderedDict[EventId, int] = attrs.field(factory=OrderedDict)
    nbytes: int = 0

    @classmethod
    def of(cls, retention: object, name: str) -> BridgeSpool:
        """The spool of bridge ``name`` in the broker's retention (None without the store)."""
        return cls(retention if isinstance(retention, Store) else None, name)

    def restore(self) -> list[Routed]:
        """Messages accepted for the bridge and not acknowledged before the restart.

        Within ``spool_max_bytes`` (the bound may have been lowered since):
        the oldest beyond it are dropped, counted, and not returned.
        """
        if self.store is None:
            return []
        found = self.store.spooled(self.name)
        for routed in found:
            self.sizes[routed.session, routed.instance] = len(routed.frame)
            self.nbytes += len(routed.frame)
        gone = set(self._trim())
        return [r for r in found if (r.session, r.instance) not in gone]

    def added(self, routed: Routed) -> list[EventId]:
        """Spool a message the bridge accepted; returns the EventIds of the oldest
        messages the byte bound pushed out of the spool (oldest first), which
        the bridge should drop from its buffer too."""
        if self.store is None:
            return []
        key = (routed.session, routed.instance)
        if key not in self.sizes:
            self.sizes[key] = len(routed.frame)
            self.nbytes += len(routed.frame)
            self.store.spool_add(self.name, routed)
        return self._trim()

    def removed(self, routed: Routed) -> None:
        """Acknowledged by the peer, refused by it, or dropped by the buffer bound."""
        if self.store is None:
            return
        size = self.sizes.pop((routed.session, routed.instance), None)
        if size is not None:  # else already pushed out by the byte bound
            self.nbytes -= size
            self.store.spool_remove(self.name, routed.session, routed.instance)

    def _trim(self) -> list[EventId]:
        assert self.store is not None
        bound = self.store.spool_max_bytes
        gone: list[EventId] = []
        if not bound or self.nbytes <= bound:
            return gone
        sizes = self.sizes
        while self.nbytes > bound and len(sizes) > 1:
            key, size = sizes.popitem(last=False)
            self.nbytes -= size
            self.store.spool_remove(self.name, *key)
            gone.append(key)
        if gone:
            self.store.spool_overflow(self.name, len(gone), bound)
        return gone

    def resume_point(self) -> tuple[int, int, int] | None:
        return None if self.store is None else self.store.resume_point(self.name)

    def set_resume(self, server: int, session: int, instance: int) -> None:
        if self.store is not None:
            self.store.set_resume(self.name, server, session, instance)
