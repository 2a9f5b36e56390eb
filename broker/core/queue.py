"""Per-connection outgoing queue and the queued endpoint base class (pure, no trio).

Routing never awaits: it pushes frames into a bounded :class:`OutQueue`
and the connection's writer task (see :mod:`broker.serving.transport`) coalesces
everything queued into one ``send_all``.  When a push would exceed the
queue's byte limit, the slow-consumer policy applies: ``disconnect`` (the
default) closes that connection, ``drop`` discards the frame; both counted.
``messages_out`` counts what entered a queue and was not discarded: a frame
that did not fit, or that a slow-consumer disconnect threw away with the
queue, is taken back out of it (the hot path stays one increment; only the
failure paths correct it).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from broker.core.reasons import CloseReason
from broker.core.router import Endpoint, Routed, Router


class SlowConsumerPolicy(StrEnum):
    """What happens when a message does not fit a connection's outgoing queue."""

    # Close the connection (the default: the consumer learns it fell behind).
    DISCONNECT = "disconnect"
    # Discard the message, count it, keep the connection.
    DROP = "drop"


DISCONNECT = SlowConsumerPolicy.DISCONNECT
DROP = SlowConsumerPolicy.DROP

# Bytes the transport reads per receive.  Routing one received chunk can add
# at most about this much to any queue before the reader gets to pause, so it
# is the headroom kept between a queue's high-water mark and its limit.
RECV_CHUNK = 256 * 1024
# Most bytes a writer joins into one send (see OutQueue.take): large enough
# that small frames travel in big batches (256 KiB cost a busy subscriber
# measurable CPU in extra sends), small enough that the copy stays well
# below a millisecond and multi-MiB frames are never joined.
COALESCE_BYTES = 4 * RECV_CHUNK
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

    def put_back(self, data: bytes) -> None:
        """Return the unsent tail of what :meth:`take` gave to the front of the queue."""
        self.items.insert(0, data)
        self.size += len(data)

    def take_all(self) -> bytes:
        items = self.items
        data = items[0] if len(items) == 1 else b"".join(items)
        self.items = []
        self.size = 0
        return data

    def take(self) -> bytes:
        """The next bytes for one send: everything queued when it is at most
        COALESCE_BYTES, else the oldest frames up to that size (at least one).

        Writers coalesce small frames into one send, but joining several
        multi-MiB frames would copy megabytes with no checkpoint in between
        (bounded work per scheduling slice): large ones go out on their own.
        """
        items = self.items
        if self.size <= COALESCE_BYTES or len(items) == 1:
            # take_all(), inlined: this runs once per direct write.
            data = items[0] if len(items) == 1 else b"".join(items)
            self.items = []
            self.size = 0
            return data
        n = total = 0
        while n < len(items) and (n == 0 or total + len(items[n]) <= COALESCE_BYTES):
            total += len(items[n])
            n += 1
        data = items[0] if n == 1 else b"".join(items[:n])
        del items[:n]
        self.size -= total
        return data


def _nothing() -> None:
    pass


class QueuedEndpoint(Endpoint):
    """An endpoint backed by a socket: deliveries become queued bytes.

    Subclasses set ``protocol`` and implement :meth:`on_bytes` (decode and
    route one received chunk, synchronously), :meth:`encode_delivery` (how
    a routed message looks on their wire) and :meth:`encode_control` (how a
    broker reply looks).  They set ``opened`` once their protocol's opening
    (Skan getlname, Eventer MsgInitReq, ...) is done and say through
    :meth:`partial_bytes` how much of an incomplete frame they hold; the trio
    layer (:func:`broker.serving.transport.run_connection`) enforces the
    handshake and frame timeouts from those, and sets ``kill`` to a callable
    that tears the connection down.
    """

    def __init__(self, router: Router, queue_limit: int, policy: str) -> None:
        super().__init__()
        self.router = router
        self.queue = OutQueue(queue_limit)
        self.policy = policy
        # Why the connection is closing (None while open); read by the transport.
        self.closing: str | None = None
        # True once the protocol's opening handshake is complete.
        self.opened = False
        # trio clock time of the last bytes received: set by the transport for
        # protocols with keep-alive (the idle pinger's liveness), the only reader.
        self.last_rx = 0.0
        # Back-pressure state, owned by the transport: flagged in router.congested,
        # since when (trio clock), and the event the writer sets once drained.
        self.congested = False
        self.congested_since: float | None = None
        self.drained: Any = None
        self.kill: Callable[[str], None] = self._detach_only
        # Frames and bytes discarded from the queue by a slow-consumer
        # disconnect (never sent; the transport logs them).
        self.unsent = (0, 0)

    def _detach_only(self, reason: str) -> None:
        self.closing = reason
        self.router.detach(self, reason)

    # -- what the transport calls (subclasses) -----------------------------

    def on_bytes(self, data: bytes) -> bool | None:  # pragma: no cover - interface
        """Handle received bytes.  An endpoint that bounds its work per slice
        returns True when input is left; the transport then calls it again
        with ``b""`` after a checkpoint (see broker.core.skan_handler.InputSlices)."""
        raise NotImplementedError

    def partial_bytes(self) -> int:
        """Bytes held of a received frame that is not complete yet (for ``frame_timeout``)."""
        return 0

    def send_ping(self) -> None:
        """Queue a keep-alive ping (protocols with keep-alive override it)."""

    def start(self, nursery: Any) -> None:
        """Start the adapter's own background tasks in the connection's nursery."""

    def on_closed(self) -> None:
        """The connection is gone (after detach); release what the adapter holds."""

    # -- what goes on the wire (subclasses) --------------------------------

    def encode_delivery(self, frame: bytes, routed: Routed) -> bytes | None:
        """Bytes for a routed message on this protocol; None to skip it."""
        return frame

    def encode_control(self, message: dict[str, Any]) -> bytes:
        raise NotImplementedError

    # -- queueing and the slow-consumer policy ------------------------------

    def pending_bytes(self) -> int:
        """Bytes waiting to reach the peer; back-pressure compares them with ``queue.high``.

        The queue's bytes; adapters that hold more outside it (Eventer's
        notifications waiting for flow-control credit) add theirs.
        """
        return self.queue.size

    def mark_congested(self) -> None:
        """Past the high-water mark: publishers routing here pause (back-pressure)."""
        if not self.congested:
            self.congested = True
            self.router.congested.append(self)

    def notify_drained(self) -> None:
        """Wake whoever waits for this consumer once it is back under its high-water mark."""
        if self.drained is not None and self.pending_bytes() <= self.queue.high:
            self.drained.set()
            self.drained = None

    def overflow(self, messages: int = 1) -> None:
        """``messages`` did not fit: apply the slow-consumer policy (the one place it lives)."""
        if self.closed:
            return
        counters = self.router.counters
        if self.policy == DROP:
            self.dropped += messages
            counters.dropped += messages
        else:
            counters.slow_consumer_disconnects += 1
            # What is queued will never be sent: it leaves messages_out (counted
            # when routed), and the memory goes now, not when the task ends.
            q = self.queue
            frames, nbytes = len(q.items), q.size
            q.items = []
            q.size = 0
            self.unsent = (frames, nbytes)
            frames += self.held_messages()
            self.msgs_out -= frames
            self.bytes_out -= nbytes
            counters.msgs_out -= frames
            counters.bytes_out -= nbytes
            self.kill(CloseReason.SLOW_CONSUMER)

    def held_messages(self) -> int:
        """Messages counted out but held outside the queue (adapters that hold some)."""
        return 0

    def not_sent(self, nbytes: int) -> None:
        """A delivery the router counted did not enter the queue (full, or closed)."""
        counters = self.router.counters
        counters.msgs_out -= 1
        counters.bytes_out -= nbytes

    def enqueue(self, data: bytes) -> bool:
        """Queue bytes for the writer, applying the slow-consumer policy when full."""
        if self.closed:
            return False
        q = self.queue
        if q.push(data):
            if q.size > q.high:
                self.mark_congested()
            return True
        self.overflow()
        return False

    def deliver(self, frame: bytes, routed: Routed) -> None:
        data = self.encode_delivery(frame, routed)
        if data is None:
            return
        if self.enqueue(data):
            self.msgs_out += 1
            self.bytes_out += len(data)
        else:
            self.not_sent(len(frame))

    def send_control(self, message: dict[str, Any]) -> None:
        self.enqueue(self.encode_control(message))
