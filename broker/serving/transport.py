"""The thin trio layer every listener and bridge shares.

One accepted connection = one nursery holding a reader loop, the writer
loop and, for protocols with keep-alive, the idle pinger.  The reader hands
each received chunk to the endpoint's synchronous ``on_bytes`` (which
decodes and routes the whole chunk without a checkpoint) and then ends the
routing batch.  The writer parks until its queue has data, then sends
everything queued at once.

:func:`serve_protocol` is the one accept loop: listeners (TCP or TLS), the
connection limits of BROKER-SPEC section 9 (``max_connections`` broker-wide
and per listener, ``handshake_timeout``, ``frame_timeout``), descriptor
exhaustion handled without a log storm, and :func:`run_connection` per
connection.  A protocol adapter only says how to make its endpoint.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import trio

from broker.core.queue import RECV_CHUNK, OutQueue, QueuedEndpoint
from broker.core.reasons import CloseReason, ErrorKind, Protocol
from broker.core.router import Router
from broker.serving import heldio, hostloop
from broker.serving.connections import Connections
from broker.serving.tls import TLSListener, server_ssl_context, tls_handshake
from toolkit.streams import idle_pinger

if TYPE_CHECKING:
    from broker.serving.config import ProtocolListener
    from broker.serving.context import BrokerContext

log = logging.getLogger(__name__)

# Bytes asked of the socket per receive: large enough that a busy publisher's
# frames arrive in big batches (one routing batch per chunk), small enough
# that one connection cannot monopolise the loop for long.
RECV_SIZE = RECV_CHUNK
# No deadline (an open connection reads without a timeout).
INF = float("inf")
# What a reader's host-loop wait returns when the loop read and routed the
# data itself and the task has the rest to do (back-pressure, a slice left).
TAKEN = b"(routed by the host loop)"

# accept() errors that mean "out of a resource" (descriptors, kernel memory):
# the listener keeps going, waiting ACCEPT_RETRY between attempts, and says
# so once per ACCEPT_LOG_INTERVAL instead of once per failed accept.
ACCEPT_CAPACITY_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)
# Seconds between accept attempts while out of descriptors: short enough
# that service resumes quickly once some are freed, long enough not to spin.
ACCEPT_RETRY = 0.1
# Seconds between two log lines about failing accepts (one listener).
ACCEPT_LOG_INTERVAL = 10.0
# Slow-consumer disconnects logged one line each, at most this many per
# interval: 10 stuck subscribers are 10 lines, a stampede of thousands is
# not thousands (the held-back ones are counted in the next line, and
# every one in slow_consumer_disconnects).
SLOW_LOG_BURST = 20
SLOW_LOG_INTERVAL = 10.0


class SlowConsumerLog:
    """One line per slow-consumer disconnect, at most SLOW_LOG_BURST per interval."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.window = -INF
        self.lines = 0
        self.held_back = 0

    def __call__(self, ep: QueuedEndpoint) -> None:
        now = self.clock()
        if now - self.window >= SLOW_LOG_INTERVAL:
            self.window, self.lines = now, 0
        if self.lines >= SLOW_LOG_BURST:
            self.held_back += 1
            return
        self.lines += 1
        frames, nbytes = ep.unsent
        more = ""
        if self.held_back:
            more = f" ({self.held_back} more not logged before this one)"
            self.held_back = 0
        log.warning("%s %s: disconnected as a slow consumer: its queue held %d frames "
                    "(%d bytes; queue_limit %d), discarded unsent%s", ep.protocol,
                    ep.lname.decode(errors="replace"), frames, nbytes, ep.queue.limit, more)


slow_consumer_log = SlowConsumerLog()
# Seconds a refused connection gets to receive its refusal before it is closed.
REFUSAL_SEND_TIMEOUT = 1.0


async def open_listeners(
    host: str,
    port: int,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    *,
    reuse_port: bool = False,
    tls_ca: str | None = None,
    client_auth: str = "none",
) -> list[trio.abc.Listener]:
    listeners: list[trio.abc.Listener]
    if reuse_port:
        listeners = await _open_shared_listeners(host, port)
    else:
        listeners = list(await trio.open_tcp_listeners(port, host=host))
    if tls_cert and tls_key:
        ctx = server_ssl_context(tls_cert, tls_key, tls_ca, client_auth)
        listeners = [TLSListener(lst, ctx) for lst in listeners]
    return listeners


async def _open_shared_listeners(host: str, port: int) -> list[trio.abc.Listener]:
    """TCP listeners with SO_REUSEPORT: every worker binds the same port."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
    listeners: list[trio.abc.Listener] = []
    for family, type_, proto, _, sockaddr in infos:
        sock = trio.socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            await sock.bind(sockaddr)
            sock.listen(LISTEN_BACKLOG)
        except OSError:
            sock.close()
            raise
        listeners.append(trio.SocketListener(sock))
    return listeners


# As trio's own default for open_tcp_listeners: the kernel caps it at somaxconn.
LISTEN_BACKLOG = 0xFFFF


async def probe_listen(host: str, port: int, *, reuse_port: bool = False) -> None:
    """Raise the OSError that binding ``host:port`` would raise now (address in
    use, not available, permission), binding as :func:`open_listeners` does and
    closing at once.

    The broker checks its ports this way before any service creates files, so
    a start that fails on a busy port leaves no store or routing-log directory
    behind.  The real bind stays the authority (the port may be taken in
    between; then start-up fails as before).  Port 0 always binds.
    """
    if port == 0:
        return
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
    for family, type_, proto, _, sockaddr in infos:
        sock = trio.socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            await sock.bind(sockaddr)
            # Linux lets a socket with SO_REUSEADDR bind beside a listening
            # one only until it listens: listen() is what reports EADDRINUSE.
            sock.listen(1)
        finally:
            sock.close()


def listener_address(listener: trio.abc.Listener) -> tuple[str, int]:
    inner = getattr(listener, "transport_listener", listener)
    host, port = inner.socket.getsockname()[:2]
    return host, port


def peer_address(stream: trio.abc.Stream) -> str | None:
    """The peer's ``host:port`` (``[v6]:port``), or None when the socket says nothing."""
    inner = getattr(stream, "transport_stream", stream)
    sock = getattr(inner, "socket", None)
    try:
        host, port = sock.getpeername()[:2]  # type: ignore[union-attr]
    except (AttributeError, OSError, TypeError, ValueError):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- the writer loop ----------------------------------------------------------------


def _noop() -> None:
    pass


async def write_loop(
    stream: trio.abc.SendStream,
    queue: OutQueue,
    *,
    done_when_empty: Callable[[], bool],
    after_send: Callable[[], None] = _noop,
    router: Router | None = None,
) -> None:
    """Send everything queued in one ``send_all`` at a time, parked while the queue is empty.

    Returns when the queue is empty and ``done_when_empty()`` is true;
    ``after_send`` runs after each send (back-pressure bookkeeping).

    With ``router`` and a plain TCP stream, what a reader's routing slice
    queues for a parked writer is sent right after that slice, by the
    routing task itself, with one non-blocking write (see
    :func:`_direct_sender`); the writer is woken only for what the socket
    did not take.  That saves a task switch per delivery at moderate rates,
    which is most of a message's latency there.
    """
    lot = trio.lowlevel.ParkingLot()
    wake = lot.unpark_all
    queue.wakeup = wake
    if router is not None and isinstance(stream, trio.SocketStream):
        queue.wakeup = _direct_sender(router, stream.socket, queue, wake, done_when_empty,
                                      after_send)
    try:
        while True:
            if not queue.size:
                if done_when_empty():
                    return
                queue.waiting = True
                await lot.park()
                continue
            await stream.send_all(queue.take())
            after_send()
    finally:
        queue.waiting = False
        queue.wakeup = _noop


def open_slice(router: Router) -> list[Callable[[], None]]:
    """Begin routing what one read brought: parked writers of the recipients
    register for a direct write instead of being woken (see write_loop)."""
    router.slice_writes = writes = []
    return writes


def close_slice(router: Router, writes: list[Callable[[], None]]) -> None:
    """End the routing batch: flush batched endpoints, write to the registered
    recipients directly, and only then hand the batch to the observers (the
    store, the routing log, metrics, the backplane): their work is off the
    path from a publisher's read to a subscriber's write."""
    router.close_batch()
    router.slice_writes = None
    try:
        for send_now in writes:
            send_now()
    finally:
        router.hand_over()


def _direct_sender(router: Router, sock: trio.socket.SocketType, queue: OutQueue,
                   wake: Callable[[], None], done_when_empty: Callable[[], bool],
                   after_send: Callable[[], None]) -> Callable[[], None]:
    """The wake-up of a parked writer that sends directly after a routing slice.

    Outside a slice (``router.slice_writes`` is None: a ping, a replay, a
    close) it wakes the writer as before.  Inside one it registers
    ``send_now``, which the slice's reader runs once the slice has ended:
    the writer is still parked then (it parks only with an empty queue, and
    nothing else runs during the slice), so the bytes go out in order.
    """

    def send_now() -> None:
        fd = sock.fileno()  # -1 once closed: then the writer sorts it out
        if queue.size and fd >= 0:
            data = queue.take()
            try:
                sent = heldio.write(fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe: the writer's send_all reports it
                sent = 0
                fd = -1
            if sent < len(data):
                queue.put_back(data[sent:] if sent else data)
            if sent:
                after_send()
        if queue.size or fd < 0 or done_when_empty():
            wake()
        else:
            queue.waiting = True  # still parked: the next push registers again

    def wakeup() -> None:
        writes = router.slice_writes
        if writes is None:
            wake()
        else:
            writes.append(send_now)

    return wakeup


class Receiver:
    """``receive_some`` for one connection's reader, without the doomed read.

    trio's ``receive_some`` tries the socket first and waits for readiness
    only when that fails.  After a read that came back short, the kernel's
    buffer was empty, so that first try is almost always a failed
    ``recvfrom`` (EAGAIN, a raised BlockingIOError) and the successful read
    that follows costs one more pass through trio's scheduler.  With
    independent publishers, one message per write, that is every message:
    two reads, two scheduler passes.  On a plain TCP socket a Receiver
    therefore waits for readiness first when the previous read was short
    (level-triggered: data that came in meanwhile answers at once) and then
    reads once.  A full read (a flood) goes through ``receive_some``, whose
    first try then usually succeeds.  TLS streams always use
    ``receive_some``.
    """

    __slots__ = ("fd_of", "short", "stream")

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.fd_of = sock.fileno if sock is not None else None
        self.short = False

    async def receive(self, size: int) -> bytes:
        """Up to ``size`` bytes; b"" at EOF.  Raises trio.BrokenResourceError
        (reset) or trio.ClosedResourceError (closed by another task), as
        ``receive_some`` does."""
        fd_of = self.fd_of
        if fd_of is None or not self.short:
            data = await self.stream.receive_some(size)
        else:
            while True:
                fd = fd_of()
                if fd < 0:
                    raise trio.ClosedResourceError("the socket was closed")
                await trio.lowlevel.wait_readable(fd)
                try:
                    data = heldio.read(fd, size)
                    break
                except BlockingIOError:  # a spurious wake-up: wait again
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc
        self.short = len(data) < size
        return data


async def _endpoint_writer(
    stream: trio.abc.SendStream, ep: QueuedEndpoint, done: trio.Event
) -> None:
    try:
        await write_loop(
            stream, ep.queue,
            done_when_empty=lambda: ep.closing is not None,
            after_send=ep.notify_drained,
            router=ep.router,
        )
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        ep.closing = ep.closing or CloseReason.RESET
    finally:
        done.set()


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


# ---- one connection ---------------------------------------------------------------------


async def run_connection(
    stream: trio.abc.Stream,
    ep: QueuedEndpoint,
    router: Router,
    connections: Connections,
    *,
    drain_timeout: float,
    grace: float = 1.0,
    ping: tuple[float, float] | None = None,
    handshake_timeout: float | None = None,
    frame_timeout: float | None = None,
) -> None:
    """Drive one accepted connection until EOF, error, kill, timeout or shutdown.

    ``ep.on_bytes`` must be synchronous and may set ``ep.closing`` to end
    the connection after what it queued (e.g. an error frame) has been sent.
    ``ping`` is ``(delay, timeout)`` for protocols with keep-alive.  A
    connection whose ``ep.opened`` is still false ``handshake_timeout``
    seconds after accept, or that holds the same incomplete frame for
    ``frame_timeout`` seconds (``ep.partial_bytes()``), is closed (counted
    as a protocol error).
    """
    writer_done = trio.Event()
    counters = router.counters
    reader_scope = trio.CancelScope()
    conn_scope = trio.CancelScope()
    now = trio.current_time()
    ep.last_rx = now
    handshake_deadline = (
        now + handshake_timeout if handshake_timeout is not None else float("inf")
    )
    frame_started: float | None = None
    on_bytes = ep.on_bytes
    receiver = Receiver(stream)
    receive = receiver.receive
    # The host loop a plain TCP reader hands its socket to between reads
    # (broker/serving/hostloop.py); None under a plain trio.run or with TLS.
    host = hostloop.current() if receiver.fd_of is not None else None
    more = False
    # Bytes the endpoint held of an incomplete frame after the last read.
    partial = 0
    # trio.current_time() without its two wrappers (once per read).
    clock_now = trio.lowlevel.current_clock().current_time

    def kill(reason: str) -> None:
        # Called synchronously from routing (slow consumer) or the pinger.
        if ep.closing is None or ep.closing == CloseReason.SHUTDOWN:
            ep.closing = reason
        router.detach(ep, reason)
        conn_scope.cancel()
        if reason == CloseReason.SLOW_CONSUMER:
            slow_consumer_log(ep)

    def stop() -> None:
        ep.closing = ep.closing or CloseReason.SHUTDOWN
        reader_scope.cancel()

    async def pinger(delay: float, timeout: float) -> None:
        async def send_ping() -> None:
            ep.send_ping()

        await idle_pinger(lambda: ep.last_rx, send_ping, delay, timeout)
        ep.kill(CloseReason.PING_TIMEOUT)

    async def pause_for_congestion() -> None:
        # Back-pressure pauses are the broker's own: the timeouts do not count them.
        nonlocal handshake_deadline, frame_started
        paused = trio.current_time()
        await relieve_congestion(router, grace)
        paused = trio.current_time() - paused
        handshake_deadline += paused
        if frame_started is not None:
            frame_started += paused

    def take(data: bytes) -> bool:
        """Route a read's ``data`` (b"": the input a slice bound left over), up
        to the endpoint's slice bound; True when the reader's task has more
        to do than wait for the next read (back-pressure, a slice left, a
        frame timeout to arm, the connection closing, the admission gate
        closed).  Sets ``more`` when input is left for another slice."""
        nonlocal frame_started, more, partial
        if data and ping is not None:
            ep.last_rx = clock_now()  # liveness, for the idle pinger
        # Routing latency (metrics): one clock pair per slice, never per message.
        latency = router.latency
        routed_before = counters.msgs_in
        started = perf_counter() if latency is not None else 0.0
        writes = open_slice(router)
        try:
            more = on_bytes(data)
        finally:
            close_slice(router, writes)
            if latency is not None:
                latency.observe(perf_counter() - started, counters.msgs_in - routed_before)
        # Only routing changes what the endpoint holds of an incomplete
        # frame: the last count is the one before this read.
        held, partial = partial, ep.partial_bytes()
        if not partial:
            frame_started = None
        elif frame_started is None or partial < held + len(data):
            # A frame completed in this chunk, so the incomplete
            # one began in it: its clock starts now.
            frame_started = clock_now()
        return (more or bool(router.congested) or ep.closing is not None
                or (frame_started is not None and frame_timeout is not None)
                or connections.gate.closed)

    def hot_step(fd: int) -> Callable[[], object]:
        """One readable event on the host loop: read and route; None to stay
        there, else what the task goes on with (b"" at end of input, True
        when it takes over: also after a full read, so a flood is read by
        the task as under plain trio.run, and the loop keeps the wake-ups
        of drained sockets, where it saves the most)."""

        def step() -> object:
            if connections.gate.closed:
                return True  # the task waits for the gate; nothing is read
            try:
                data = heldio.read(fd, RECV_SIZE)
            except BlockingIOError:  # a spurious wake-up
                return None
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            if not data:
                return b""
            if len(data) == RECV_SIZE:
                # A full read: more is likely waiting (a flood).  The task's
                # reads try the socket first, and trio, busy with them, does
                # not hand its own waits to a helper thread each time.
                receiver.short = False
                take(data)
                return True
            return True if take(data) else None

        return step

    def timed_out(kind: ErrorKind, reason: CloseReason, what: str) -> None:
        counters.protocol_error(ep.protocol, kind)
        log.info("%s %s: closing: %s", ep.protocol, ep.lname.decode(), what)
        ep.closing = reason

    try:
        # TLS first (the client certificate names the user), within the
        # same handshake deadline as the protocol's opening.
        if not await tls_handshake(stream, ep, router, handshake_timeout):
            return
        with conn_scope:
            async with trio.open_nursery() as nursery:
                ep.kill = kill
                connections.add(stop)
                nursery.start_soon(_endpoint_writer, stream, ep, writer_done)
                if ping is not None:
                    nursery.start_soon(pinger, *ping)
                ep.start(nursery)
                gate = connections.gate
                with reader_scope:
                    while ep.closing is None:
                        if gate.closed:
                            # The broker's own pause is not the peer's delay.
                            paused = trio.current_time()
                            await gate.wait_open()
                            paused = trio.current_time() - paused
                            handshake_deadline += paused
                            if frame_started is not None:
                                frame_started += paused
                        deadline = handshake_deadline if not ep.opened else INF
                        if frame_started is not None and frame_timeout is not None:
                            deadline = min(deadline, frame_started + frame_timeout)
                        data = None
                        try:
                            if deadline == INF and host is not None and receiver.short:
                                # Open, nothing pending, the socket drained: the
                                # host loop reads and routes until something
                                # needs this task (hostloop.py).
                                fd = receiver.fd_of()  # type: ignore[misc]
                                if fd < 0:
                                    raise trio.ClosedResourceError("the socket was closed")
                                data = await host.serve(fd, hot_step(fd))
                                if data is True:
                                    data = TAKEN  # routed by the host loop
                            elif deadline == INF:
                                # The common case once open: no timeout, so no
                                # cancel scope per read (it costs a few µs each).
                                data = await receive(RECV_SIZE)
                            else:
                                with trio.move_on_at(deadline):
                                    data = await receive(RECV_SIZE)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            ep.closing = CloseReason.RESET
                            break
                        if data is None:
                            if not ep.opened and trio.current_time() >= handshake_deadline:
                                timed_out(ErrorKind.HANDSHAKE_TIMEOUT,
                                          CloseReason.HANDSHAKE_TIMEOUT,
                                          f"no {ep.protocol} handshake within "
                                          f"{handshake_timeout}s")
                            else:
                                timed_out(ErrorKind.FRAME_TIMEOUT, CloseReason.FRAME_TIMEOUT,
                                          f"a frame was not completed within "
                                          f"{frame_timeout}s")
                            break
                        if not data:
                            ep.closing = CloseReason.EOF
                            break
                        if data is not TAKEN:
                            take(data)
                        if router.congested:
                            await pause_for_congestion()
                        # Bounded work per slice: an endpoint that stopped at its
                        # slice bound (broker.core.skan_handler.SLICE_SECONDS) with input
                        # left is resumed after a checkpoint, so one connection's
                        # burst never holds the event loop for the whole chunk.
                        while more and ep.closing is None:
                            await trio.lowlevel.checkpoint()
                            take(b"")
                            if router.congested:
                                await pause_for_congestion()
                # Let the writer send what is queued (error frame, replies), then close.
                router.detach(ep, ep.closing or CloseReason.CLOSED)
                ep.queue.wakeup()
                with trio.move_on_after(drain_timeout):
                    await writer_done.wait()
                conn_scope.cancel()
    except trio.BrokenResourceError:
        ep.closing = ep.closing or CloseReason.RESET
    finally:
        connections.discard(stop)
        router.detach(ep, ep.closing or CloseReason.CLOSED)
        ep.on_closed()
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await trio.aclose_forcefully(stream)


# ---- accepting ------------------------------------------------------------------------------


class AcceptErrorLog:
    """Says that accept() is failing once per interval, with how often, never per failure."""

    def __init__(self, protocol: str, interval: float = ACCEPT_LOG_INTERVAL) -> None:
        self.protocol = protocol
        self.interval = interval
        self.failures = 0
        self._last_logged: float | None = None
        self._since_log = 0

    def failed(self, exc: OSError) -> None:
        self.failures += 1
        self._since_log += 1
        now = trio.current_time()
        if self._last_logged is None or now - self._last_logged >= self.interval:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if self._last_logged is None:
                what = f"accept failed ({name}: {exc.strerror})"
            else:
                what = (f"accept failed {self._since_log} times in the last "
                        f"{now - self._last_logged:.0f}s ({name})")
            log.warning(
                "%s listener: %s; connections already open are still served, new ones "
                "wait (said at most every %.0fs)", self.protocol, what, self.interval,
            )
            self._last_logged = now
            self._since_log = 0


async def accept_loop(
    listener: trio.abc.Listener,
    handle: Callable[[trio.abc.Stream], Any],
    nursery: trio.Nursery,
    errors: AcceptErrorLog,
    on_accept_error: Callable[[], None] = _noop,
) -> None:
    """Accept forever, starting ``handle(stream)`` in ``nursery`` for each connection.

    Running out of descriptors (EMFILE, ENFILE, ...) pauses this listener
    for ACCEPT_RETRY and is logged through ``errors``; other OSErrors are
    the listener's end (they propagate).
    """
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                errors.failed(exc)
                on_accept_error()
                await trio.sleep(ACCEPT_RETRY)
                continue
            nursery.start_soon(handle, stream)


def make_handler(
    factory: Callable[[trio.abc.Stream], Any],
) -> Callable[[trio.abc.Stream], Any]:
    """Wrap a per-connection coroutine so no exception from one peer reaches the listener."""

    async def handler(stream: trio.abc.Stream) -> None:
        try:
            await factory(stream)
        except trio.Cancelled:
            raise
        except Exception:
            log.exception("connection handler failed")

    return handler


async def _refuse(stream: trio.abc.Stream, refusal: bytes | None) -> None:
    """Send a protocol's refusal (if it has one) and close, bounded in time."""
    try:
        if refusal:
            with trio.move_on_after(REFUSAL_SEND_TIMEOUT):
                await stream.send_all(refusal)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await trio.aclose_forcefully(stream)


async def serve_protocol(
    ctx: BrokerContext,
    protocol: Protocol,
    section: ProtocolListener,
    new_endpoint: Callable[[], QueuedEndpoint],
    *,
    keep_alive: tuple[float, float] | None = None,
    refusal: bytes | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one protocol's listener(s) until cancelled: the one accept path of every protocol.

    ``section`` is the listener's config section (port, TLS, per-listener
    ``max_connections``); ``keep_alive`` is ``(ping_delay, ping_timeout)``
    for protocols that ping idle peers.  ``new_endpoint()`` makes a fresh endpoint, which this
    attaches to the router and runs with :func:`run_connection`.  A
    connection over a limit gets ``refusal`` (the protocol's own way of
    saying "too many connections", if any) and is closed; counted.
    """
    cfg = ctx.config.broker
    router = ctx.router
    listeners = await open_listeners(
        cfg.host, section.port, section.tls_cert, section.tls_key, reuse_port=cfg.reuse_port,
        tls_ca=section.tls_ca, client_auth=section.tls_client_auth,
    )
    # A configuration reload replaces their TLS contexts (broker.app.reload).
    ctx.tls_listeners[str(protocol)] = [lst for lst in listeners if isinstance(lst, TLSListener)]
    limits = ctx.limits
    errors = AcceptErrorLog(protocol)

    async def handle(stream: trio.abc.Stream) -> None:
        # Limits as (re)loaded: a SIGHUP reload applies them to new connections.
        cfg = ctx.config.broker
        listener_max = getattr(getattr(ctx.config, str(protocol)), "max_connections", None)
        refused = limits.admit(protocol, listener_max)
        if refused is not None:
            router.counters.refuse(protocol, refused)
            await _refuse(stream, refusal)
            return
        try:
            ep = new_endpoint()
            ep.remote = peer_address(stream)  # once per connection (the listing shows it)
            router.attach(ep)
            await run_connection(
                stream, ep, router, ctx.connections,
                drain_timeout=cfg.drain_timeout, grace=cfg.slow_consumer_grace,
                ping=keep_alive, handshake_timeout=cfg.handshake_timeout,
                frame_timeout=cfg.frame_timeout,
            )
        finally:
            limits.release(protocol)

    def accept_failed() -> None:
        router.counters.accept_errors += 1

    handler = make_handler(handle)
    task_status.started([(str(protocol), *listener_address(lst)) for lst in listeners])
    assert ctx.conn_nursery is not None
    async with trio.open_nursery() as nursery:
        for lst in listeners:
            nursery.start_soon(accept_loop, lst, handler, ctx.conn_nursery, errors,
                               accept_failed)
