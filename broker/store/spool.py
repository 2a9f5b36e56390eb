"""A bridge's view of the store: its spool of unacknowledged messages and its resume point.

A bridge is known in the store by its name (``protocol-index-address``, see
:func:`broker.runtime.bridge.bridge_name`), so its spool is found again
after a restart as long as its ``[[bridges]]`` entry keeps its place and
address.  Without a store (``[store] enabled = false``) every method does
nothing and the buffer lives in memory only.
"""

from __future__ import annotations

import attrs

from broker.core.router import Routed
from broker.store.store import Store


@attrs.define(eq=False)
class BridgeSpool:
    store: Store | None
    name: str

    @classmethod
    def of(cls, retention: object, name: str) -> BridgeSpool:
        """The spool of bridge ``name`` in the broker's retention (None without the store)."""
        return cls(retention if isinstance(retention, Store) else None, name)

    def restore(self) -> list[Routed]:
        """Messages accepted for the bridge and not acknowledged before the restart."""
        return [] if self.store is None else self.store.spooled(self.name)

    def added(self, routed: Routed) -> None:
        if self.store is not None:
            self.store.spool_add(self.name, routed)

    def removed(self, routed: Routed) -> None:
        """Acknowledged by the peer, refused by it, or dropped by the buffer bound."""
        if self.store is not None:
            self.store.spool_remove(self.name, routed.session, routed.instance)

    def resume_point(self) -> tuple[int, int, int] | None:
        return None if self.store is None else self.store.resume_point(self.name)

    def set_resume(self, server: int, session: int, instance: int) -> None:
        if self.store is not None:
            self.store.set_resume(self.name, server, session, instance)
