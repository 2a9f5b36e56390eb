"""The thin trio layer every listener shares: listeners, TLS, connection tasks.

One connection = one nursery holding a reader loop, a writer task and, for
protocols with keep-alive, an idle pinger.  The reader hands each received
chunk to the adapter's synchronous ``on_bytes`` (which decodes and routes
the whole chunk without a checkpoint) and then ends the routing batch.  The
writer parks until its queue has data, then sends everything queued at once.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable

import trio

from broker.core.queue import RECV_CHUNK, QueuedEndpoint
from broker.core.router import Router

log = logging.getLogger(__name__)

# Bytes asked of the socket per receive: large enough that a busy publisher's
# frames arrive in big batches (one routing batch per chunk), small enough
# that one connection cannot monopolise the loop for long.
RECV_SIZE = RECV_CHUNK


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


async def open_listeners(
    host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None
) -> list[trio.abc.Listener]:
    listeners: list[trio.abc.Listener] = list(await trio.open_tcp_listeners(port, host=host))
    if tls_cert and tls_key:
        ctx = server_ssl_context(tls_cert, tls_key)
        listeners = [
            trio.SSLListener(lst, ctx, https_compatible=False) for lst in listeners
        ]
    return listeners


def listener_address(listener: trio.abc.Listener) -> tuple[str, int]:
    inner = listener.transport_listener if isinstance(listener, trio.SSLListener) else listener
    host, port = inner.socket.getsockname()[:2]
    return host, port


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
        self.stopping = False
        self.gate = AdmissionGate()

    def add(self, stop: Callable[[], None]) -> None:
        self._stops.add(stop)

    def discard(self, stop: Callable[[], None]) -> None:
        self._stops.discard(stop)

    def stop_all(self) -> None:
        self.stopping = True
        for stop in list(self._stops):
            stop()

    def __len__(self) -> int:
        return len(self._stops)


async def _writer(stream: trio.abc.SendStream, ep: QueuedEndpoint, done: trio.Event) -> None:
    queue = ep.queue
    lot = trio.lowlevel.ParkingLot()
    queue.wakeup = lot.unpark_all
    try:
        while True:
            if not queue.size:
                if ep.closing is not None:
                    return
                queue.waiting = True
                await lot.park()
                continue
            await stream.send_all(queue.take_all())
            if ep.drained is not None and ep.pending_bytes() <= queue.high:
                ep.drained.set()
                ep.drained = None
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        ep.closing = ep.closing or "reset"
    finally:
        queue.waiting = False
        queue.wakeup = _noop
        done.set()


def _noop() -> None:
    pass


async def relieve_congestion(router: Router, grace: float) -> None:
    """Back-pressure: pause this reader until congested queues drain (bounded by ``grace``).

    A consumer that stays congested for longer than ``grace`` seconds is not
    waited for any more: its queue then fills to the limit and the
    slow-consumer policy (disconnect or drop) applies.
    """
    congested, router.congested = router.congested, []
    for ep in congested:
        ep.congested = False
        q = ep.queue
        if ep.closed or ep.pending_bytes() <= q.high:
            ep.congested_since = None
            continue
        now = trio.current_time()
        if ep.congested_since is None:
            ep.congested_since = now
        remaining = ep.congested_since + grace - now
        if remaining <= 0:
            continue
        if ep.drained is None:
            ep.drained = trio.Event()
        with trio.move_on_after(remaining):
            await ep.drained.wait()
        if ep.pending_bytes() <= q.high:
            ep.congested_since = None


async def idle_pinger(
    ep: QueuedEndpoint,
    send_ping: Callable[[], None],
    delay: float,
    timeout: float,
) -> None:
    """Ping a peer idle for ``delay`` seconds; close it if nothing arrives within ``timeout``."""
    while True:
        idle_until = ep.last_rx + delay
        now = trio.current_time()
        if now < idle_until:
            await trio.sleep(idle_until - now)
            continue
        pinged_at = trio.current_time()
        send_ping()
        await trio.sleep(timeout)
        if ep.last_rx < pinged_at:
            ep.kill("ping-timeout")
            return


async def run_connection(
    stream: trio.abc.Stream,
    ep: QueuedEndpoint,
    on_bytes: Callable[[bytes], bool | None],
    router: Router,
    connections: Connections,
    *,
    drain_timeout: float,
    grace: float = 1.0,
    extra_tasks: Callable[[trio.Nursery], None] | None = None,
    on_start: Callable[[], None] | None = None,
) -> None:
    """Drive one accepted connection until EOF, error, kill or shutdown.

    ``on_bytes`` must be synchronous and may set ``ep.closing`` to end the
    connection after what it queued (e.g. an error frame) has been sent.
    """
    writer_done = trio.Event()
    counters = router.counters
    reader_scope = trio.CancelScope()
    conn_scope = trio.CancelScope()
    ep.last_rx = trio.current_time()

    def kill(reason: str) -> None:
        # Called synchronously from routing (slow consumer) or the pinger.
        if ep.closing is None or ep.closing == "shutdown":
            ep.closing = reason
        router.detach(ep, reason)
        conn_scope.cancel()

    def stop() -> None:
        ep.closing = ep.closing or "shutdown"
        reader_scope.cancel()

    try:
        with conn_scope:
            async with trio.open_nursery() as nursery:
                ep.kill = kill
                connections.add(stop)
                nursery.start_soon(_writer, stream, ep, writer_done)
                if extra_tasks is not None:
                    extra_tasks(nursery)
                if on_start is not None:
                    on_start()
                gate = connections.gate
                with reader_scope:
                    while ep.closing is None:
                        if gate.closed:
                            await gate.wait_open()
                        try:
                            data = await stream.receive_some(RECV_SIZE)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            ep.closing = "reset"
                            break
                        if not data:
                            ep.closing = "eof"
                            break
                        ep.last_rx = trio.current_time()
                        # Routing latency (metrics): one clock pair per chunk, never per message.
                        latency = router.latency
                        if latency is not None:
                            routed_before = counters.msgs_in
                            started = time.perf_counter()
                        try:
                            more = on_bytes(data)
                        finally:
                            router.end_batch()
                        if latency is not None:
                            latency.observe(
                                time.perf_counter() - started, counters.msgs_in - routed_before
                            )
                        if router.congested:
                            await relieve_congestion(router, grace)
                        # Bounded work per slice: an adapter that stopped at its
                        # slice bound (broker.core.session.SLICE_SECONDS) with input
                        # left is resumed after a checkpoint, so one connection's
                        # burst never holds the event loop for the whole chunk.
                        while more and ep.closing is None:
                            await trio.lowlevel.checkpoint()
                            try:
                                more = on_bytes(b"")
                            finally:
                                router.end_batch()
                            if router.congested:
                                await relieve_congestion(router, grace)
                # Let the writer send what is queued (error frame, replies), then close.
                router.detach(ep, ep.closing or "closed")
                ep.queue.wakeup()
                with trio.move_on_after(drain_timeout):
                    await writer_done.wait()
                conn_scope.cancel()
    except trio.BrokenResourceError:
        ep.closing = ep.closing or "reset"
    finally:
        connections.discard(stop)
        router.detach(ep, ep.closing or "closed")
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await trio.aclose_forcefully(stream)


def make_handler(
    factory: Callable[[trio.abc.Stream], Awaitable[None]],
) -> Callable[[trio.abc.Stream], Awaitable[None]]:
    """Wrap a per-connection coroutine so no exception from one peer reaches the listener."""

    async def handler(stream: trio.abc.Stream) -> None:
        try:
            await factory(stream)
        except trio.Cancelled:
            raise
        except Exception:
            log.exception("connection handler failed")

    return handler
