"""The live connections of a broker: admission (back-pressure gate), the
stop hooks a graceful shutdown drains, and the connection limits of
BROKER-SPEC section 9."""

from __future__ import annotations

from collections.abc import Callable

import trio

from broker.core.reasons import RefusalReason


class AdmissionGate:
    """Lets components pause reading from every connection (back-pressure).

    Routing is synchronous and must never block, so a component that cannot
    keep up (the routing log's disk writer) closes the gate instead; every
    connection's reader checks it before each ``receive_some`` and waits
    while it is closed, so TCP pushes back on the senders.  Each component
    closes and opens it under its own name; it is open when nobody holds it
    closed.  ``waits`` counts the reads that had to wait.  Trio thread only.
    """

    def __init__(self) -> None:
        self.closed = False
        self.waits = 0
        self._holders: set[str] = set()
        self._opened = trio.Event()
        self._opened.set()

    def close(self, holder: str) -> None:
        self._holders.add(holder)
        if not self.closed:
            self.closed = True
            self._opened = trio.Event()

    def open(self, holder: str) -> None:
        self._holders.discard(holder)
        if self.closed and not self._holders:
            self.closed = False
            self._opened.set()

    async def wait_open(self) -> None:
        if self.closed:
            self.waits += 1
            await self._opened.wait()


class Connections:
    """Every live connection's stop hook, so a graceful shutdown can drain them all.

    ``gate`` is the admission gate every connection's reader honours.
    """

    def __init__(self) -> None:
        self._stops: set[Callable[[], None]] = set()
        self.gate = AdmissionGate()

    def add(self, stop: Callable[[], None]) -> None:
        self._stops.add(stop)

    def discard(self, stop: Callable[[], None]) -> None:
        self._stops.discard(stop)

    def stop_all(self) -> None:
        for stop in list(self._stops):
            stop()

    def __len__(self) -> int:
        return len(self._stops)


class ConnectionLimits:
    """Live connection counts against ``max_connections`` (broker-wide and per listener).

    Counts every accepted client connection of the four protocol listeners
    (bridges and metrics clients are not counted).
    """

    def __init__(self, broker_max: int) -> None:
        self.broker_max = broker_max
        self.total = 0
        self.per_listener: dict[str, int] = {}

    def admit(self, protocol: str, listener_max: int | None) -> RefusalReason | None:
        """Take a slot for a new connection, or say why there is none."""
        if self.total >= self.broker_max:
            return RefusalReason.BROKER_LIMIT
        mine = self.per_listener.get(protocol, 0)
        if listener_max is not None and mine >= listener_max:
            return RefusalReason.LISTENER_LIMIT
        self.total += 1
        self.per_listener[protocol] = mine + 1
        return None

    def release(self, protocol: str) -> None:
        self.total -= 1
        self.per_listener[protocol] -= 1
