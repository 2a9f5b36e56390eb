"""Per-connection outgoing queue and the queued endpoint base class (pure, no trio).

Routing never awaits: it pushes frames into a bounded :class:`OutQueue`
and the connection's writer task (see :mod:`broker.runtime.transport`) coalesces
everything queued into one ``send_all``.  When a push would exceed the
queue's byte limit, the slow-consumer policy applies: ``disconnect`` (the
default) closes that connection, ``drop`` discards the frame; both counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.core.router import Endpoint, Routed, Router

DISCONNECT = "disconnect"
DROP = "drop"

# Bytes the transport reads per receive.  Routing one received chunk can add
# at most about this much to any queue before the reader gets to pause, so it
# is the headroom kept between a queue's high-water mark and its limit.
RECV_CHUNK = 256 * 1024
# Smallest accepted queue_limit: room for the high-water mark plus two chunks.
MIN_QUEUE_LIMIT = 4 * RECV_CHUNK


class OutQueue:
    """A byte-bounded FIFO of frames with a wake-up hook for a parked writer."""

    __slots__ = ("high", "items", "limit", "size", "waiting", "wakeup")

    def __init__(self, limit: int) -> None:
        self.items: list[bytes] = []
        self.size = 0
        self.limit = limit
        # Above this the queue is congested: publishers routing to it pause
        # (back-pressure) for up to the grace period before the policy applies.
        self.high = min(limit // 2, limit - 2 * RECV_CHUNK)
        # Set by the writer just before it parks; push wakes it once.
        self.waiting = False
        self.wakeup: Callable[[], None] = _nothing

    def push(self, data: bytes) -> bool:
        n = len(data)
        if self.size + n > self.limit:
            return False
        self.items.append(data)
        self.size += n
        if self.waiting:
            self.waiting = False
            self.wakeup()
        return True

    def take_all(self) -> bytes:
        items = self.items
        data = items[0] if len(items) == 1 else b"".join(items)
        self.items = []
        self.size = 0
        return data


def _nothing() -> None:
    pass


class QueuedEndpoint(Endpoint):
    """An endpoint backed by a socket: deliveries become queued bytes.

    Subclasses set ``protocol`` and override :meth:`encode_delivery` (how a
    routed message looks on their wire) and :meth:`encode_control` (how a
    broker reply looks).  The trio layer sets ``kill`` to a callable that
    tears the connection down.
    """

    def __init__(self, router: Router, queue_limit: int, policy: str) -> None:
        super().__init__()
        self.router = router
        self.queue = OutQueue(queue_limit)
        self.policy = policy
        # Why the connection is closing (None while open); read by the transport.
        self.closing: str | None = None
        # trio clock time of the last bytes received (set by the transport).
        self.last_rx = 0.0
        # Back-pressure state, owned by the transport: flagged in router.congested,
        # since when (trio clock), and the event the writer sets once drained.
        self.congested = False
        self.congested_since: float | None = None
        self.drained: Any = None
        self.kill: Callable[[str], None] = self._detach_only

    def _detach_only(self, reason: str) -> None:
        self.closing = reason
        self.router.detach(self, reason)

    # -- what goes on the wire (subclasses) --------------------------------

    def encode_delivery(self, frame: bytes, routed: Routed) -> bytes | None:
        """Bytes for a routed message on this protocol; None to skip it."""
        return frame

    def encode_control(self, message: dict[str, Any]) -> bytes:
        raise NotImplementedError

    # -- queueing ----------------------------------------------------------

    def pending_bytes(self) -> int:
        """Bytes waiting to reach the peer; back-pressure compares them with ``queue.high``.

        The queue's bytes; adapters that hold more outside it (Eventer's
        notifications waiting for flow-control credit) add theirs.
        """
        return self.queue.size

    def enqueue(self, data: bytes) -> bool:
        """Queue bytes for the writer, applying the slow-consumer policy when full."""
        if self.closed:
            return False
        q = self.queue
        if q.push(data):
            if q.size > q.high and not self.congested:
                self.congested = True
                self.router.congested.append(self)
            return True
        counters = self.router.counters
        if self.policy == DROP:
            self.dropped += 1
            counters.dropped += 1
        else:
            counters.slow_consumer_disconnects += 1
            self.kill("slow-consumer")
        return False

    def deliver(self, frame: bytes, routed: Routed) -> None:
        data = self.encode_delivery(frame, routed)
        if data is not None and self.enqueue(data):
            self.msgs_out += 1
            self.bytes_out += len(data)

    def send_control(self, message: dict[str, Any]) -> None:
        self.enqueue(self.encode_control(message))
