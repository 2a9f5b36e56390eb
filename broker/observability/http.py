"""The ``metrics`` service: GET /metrics and /healthz on the broker's own trio loop.

Three layers, from pure to trio:

- :class:`ServerConnection` wraps one h11 server connection (the field's
  sans-IO HTTP/1.1 library: bytes in, events out) and adds this endpoint's
  own rules on top of it: only HTTP/1.0 and 1.1, at most ``MAX_HEADERS``
  ASCII header fields, a request head of at most ``MAX_HEAD`` bytes, and no
  request bodies (a request with one is answered and the connection
  closed).  It hands out :class:`Request` or :class:`HTTPError` items and
  turns a :class:`Reply` into response bytes.  No trio.
- :func:`answer` (pure) maps a request to a :class:`Reply`;
  :meth:`MetricsHTTP.respond` first applies the listener's access rules
  (:mod:`broker.observability.access`: bearer token, basic auth, 401 with
  ``WWW-Authenticate``) and answers the connection listing
  (:mod:`broker.observability.listing`, ``/connections`` and
  ``/subscriptions``, JSON from bounded snapshots).
- :class:`MetricsHTTP` is the thin trio layer: admission (at most
  ``MAX_CONNECTIONS``, idle ones evicted first), reads with deadlines, writes
  with a send timeout.  No thread: the scrape body is rendered synchronously
  on the event loop (a few milliseconds; the scrape is one client every few
  seconds).

Behaviour an operator can rely on is listed in docs/metrics.md ("The HTTP
server").  Peer faults (malformed requests, timeouts, refusals) are counted
as ``skan_protocol_errors_total{protocol="metrics"}`` with one INFO log line
each, never a traceback.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import attrs
import h11
import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from broker.core.reasons import LISTENER_PROTOCOLS
from broker.observability.access import MetricsAccess
from broker.observability.latency import RouteLatency
from broker.observability.listing import BadQuery, Listing
from broker.observability.metrics import build_registry, prune_group_stats
from broker.serving.config import is_loopback
from broker.serving.context import BrokerContext
from broker.serving.transport import (
    AcceptErrorLog,
    accept_loop,
    listener_address,
    open_listeners,
    peer_address,
)

log = logging.getLogger(__name__)

# The protocol label of this listener's faults in skan_protocol_errors_total.
PROTOCOL = "metrics"

# A request head larger than this is refused (431): a scrape request is a
# few hundred bytes, and the limit caps what one client can make us buffer
# (h11's max_incomplete_event_size).
MAX_HEAD = 8192
# Header fields per request; real scrapers send fewer than ten.
MAX_HEADERS = 64
# Concurrent HTTP connections.  Scrapers are few; the cap bounds the tasks
# and buffers HTTP clients can make the broker hold.  At the cap a new
# connection takes the place of an idle or unfinished one (see
# MetricsHTTP._victim); only when all of them are being answered right now
# does it get 503.
MAX_CONNECTIONS = 32
# Seconds a kept-alive connection may sit idle between requests: longer than
# Prometheus' default 60 s scrape interval, so regular scrapes reuse it.
IDLE_TIMEOUT = 75.0
# Seconds from a connection's opening (or a later request's first byte) to a
# complete request head.  A scraper sends its request at once, so a few
# seconds is generous; idle or trickling clients are closed this soon and
# cannot hold slots that scrapes need (slow-loris guard).
REQUEST_TIMEOUT = 5.0
# Seconds to hand one response to a client that is not reading.
SEND_TIMEOUT = 10.0
# Seconds a reply may take to hand over before, at the connection cap, its
# connection may be closed for a new one: a scrape body is tens of KiB and
# fits in the socket buffers at once, so a longer send means the client is
# not reading.
ANSWER_GRACE = 1.0
RECV_SIZE = 8192
# How often the per-group table is pruned when nobody scrapes.
PRUNE_INTERVAL = 10.0
# Longest peer-supplied text echoed into an error body or a log line.
ECHO_LIMIT = 120

TEXT = "text/plain; charset=utf-8"
ALLOW = (("Allow", "GET, HEAD"),)
JSON = "application/json"
INDEX = (b"Skan broker: /metrics (Prometheus text format), /healthz, /connections and "
         b"/subscriptions (JSON; see docs/metrics.md)\n")
# Paths answered without credentials even when some are configured: load
# balancers and orchestrators probe liveness without them.
OPEN_PATHS = ("/healthz",)
LISTING_PATHS = ("/connections", "/subscriptions")

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class Fault(enum.StrEnum):
    """Label values (``reason``) of the metrics listener's protocol errors."""

    MALFORMED = "malformed"  # 400/501: h11 or our own rules refused the request
    TOO_LARGE = "too-large"  # 431: head over MAX_HEAD or over MAX_HEADERS fields
    VERSION = "unsupported-version"  # 505: HTTP/2 or later on this port
    TIMEOUT = "request-timeout"  # 408 (or a silent close): no complete request in time
    REFUSED = "too-many-connections"  # 503: every slot busy answering
    SLOW_READER = "send-timeout"  # the client did not read its response
    EVICTED = "evicted"  # unfinished request closed to admit a new connection


_FAULT_BY_STATUS = {431: Fault.TOO_LARGE, 505: Fault.VERSION}


@attrs.frozen
class Request:
    method: str
    target: str
    # (1, 1) for HTTP/1.1
    version: tuple[int, int]
    # Field names lower-cased, values as sent (ASCII), in arrival order.
    headers: tuple[tuple[str, str], ...]
    # A body follows (Content-Length > 0 or Transfer-Encoding): never read.
    has_body: bool = False

    def header(self, name: str) -> str | None:
        """The last value of a header field (names compare case-insensitively)."""
        name = name.lower()
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told ``close``; HTTP/1.0 always closes."""
        tokens = {t.strip().lower() for t in (self.header("connection") or "").split(",")}
        return self.version >= (1, 1) and "close" not in tokens


@attrs.frozen
class HTTPError:
    """The request could not be accepted; answer ``status`` with ``reason`` and close."""

    status: int
    reason: str

    @property
    def fault(self) -> Fault:
        return _FAULT_BY_STATUS.get(self.status, Fault.MALFORMED)


@attrs.frozen
class Reply:
    status: int
    body: bytes = b""
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()
    # Close after this reply even if the request allowed keep-alive.
    close: bool = False


def _echo(text: str) -> str:
    return text if len(text) <= ECHO_LIMIT else text[:ECHO_LIMIT] + "..."


class ServerConnection:
    """One HTTP/1.1 server connection: h11 plus this endpoint's rules.  Sans-IO.

    Feed received bytes with :meth:`receive_data` (``b""`` for end of
    stream), take the next complete request with :meth:`next_request`, and
    turn its :class:`Reply` into bytes with :meth:`send_reply`.  Requests are
    taken one at a time (pipelined ones wait in h11's buffer); after an
    :class:`HTTPError`, or a reply that closes, :attr:`closed` is true and
    the caller closes the transport.
    """

    def __init__(self, max_head: int = MAX_HEAD) -> None:
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head
        self._current: Request | HTTPError | None = None
        # The request being answered is a HEAD (its response has no body).
        self._head = False
        # True once the last reply said "Connection: close".
        self.closed = False
        # True once the peer ended its side of the stream.
        self.peer_closed = False

    @property
    def buffered(self) -> int:
        """Received bytes of requests not handed out yet (0 between requests)."""
        return len(self._h11.trailing_data[0])

    def receive_data(self, data: bytes) -> None:
        """Bytes received from the peer; ``b""`` means it closed (nothing counts after that)."""
        if self.peer_closed:
            return
        if not data:
            self.peer_closed = True
        elif self._h11.their_state is h11.IDLE and not self.buffered:
            # A server SHOULD ignore empty lines before a request line (RFC
            # 9112 section 2.2); h11 does not, so skip them here.
            data = data.lstrip(b"\r\n")
            if not data:
                return
        self._h11.receive_data(data)

    def next_request(self) -> Request | HTTPError | None:
        """The next request, an error to answer before closing, or None (more bytes needed)."""
        if self._current is not None:
            raise RuntimeError("reply to the current request first")
        if self.closed:
            return None
        try:
            event = self._h11.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            if status == 431:
                reason = f"request head exceeds {self.max_head} bytes"
            else:
                reason = f"malformed request: {_echo(str(exc))}"
            self._current = HTTPError(status, reason)
            return self._current
        if isinstance(event, h11.Request):
            # h11 frames the response to a HEAD request without a body, even
            # an error response (505 for "HEAD / HTTP/2.0"): remember it.
            self._head = event.method == b"HEAD"
            self._current = self._check(event)
            return self._current
        if isinstance(event, h11.ConnectionClosed):
            self.peer_closed = True
        return None  # NEED_DATA; PAUSED cannot happen: one request at a time

    def _check(self, event: h11.Request) -> Request | HTTPError:
        major, _, minor = event.http_version.decode("ascii").partition(".")
        if major != "1":
            return HTTPError(505, "only HTTP/1.0 and HTTP/1.1 are supported")
        if len(event.headers) > MAX_HEADERS:
            return HTTPError(431, f"more than {MAX_HEADERS} header fields")
        try:
            headers = tuple((name.decode("ascii"), value.decode("ascii"))
                            for name, value in event.headers)
        except UnicodeDecodeError:
            return HTTPError(400, "header field values must be ASCII")
        length = 0
        chunked = False
        for name, value in headers:
            if name == "content-length":
                length = int(value)  # h11 checked it is a short run of digits
            elif name == "transfer-encoding":
                chunked = True
        return Request(
            event.method.decode("ascii"),
            event.target.decode("ascii"),
            (1, int(minor)),
            headers,
            has_body=chunked or length > 0,
        )

    def fail(self, status: int, text: str) -> bytes:
        """A closing error response outside a request cycle (408 timeout, 503 refusal)."""
        self._current = HTTPError(status, text)
        return self.send_reply(Reply(status, f"{text}\n".encode(), close=True))

    def send_reply(self, reply: Reply) -> bytes:
        """Response bytes for the current request (HEAD: head only, same Content-Length)."""
        item, self._current = self._current, None
        if item is None:
            raise RuntimeError("no request to reply to")
        keep = (isinstance(item, Request) and item.keep_alive and not item.has_body
                and not reply.close)
        headers = [
            ("Content-Type", reply.content_type),
            ("Content-Length", str(len(reply.body))),
            ("Connection", "keep-alive" if keep else "close"),
            *reply.headers,
        ]
        conn = self._h11
        out = conn.send(h11.Response(status_code=reply.status, headers=headers,
                                     reason=REASONS.get(reply.status, "Unknown")))
        if not self._head:
            out += conn.send(h11.Data(data=reply.body))
        self._head = False
        out += conn.send(h11.EndOfMessage())
        if keep:
            # The request had no body: its end is already in h11's buffer.
            end = conn.next_event()
            if isinstance(end, h11.EndOfMessage) and conn.our_state is h11.DONE:
                conn.start_next_cycle()
            else:
                keep = False
        self.closed = not keep
        return out


def answer(item: Request | HTTPError, render_metrics: Callable[[], bytes]) -> Reply:
    """What to reply to one request (pure: path and method in, reply out)."""
    if isinstance(item, HTTPError):
        return Reply(item.status, f"{item.reason}\n".encode(), close=True)
    if item.method not in ("GET", "HEAD"):
        body = f"method {_echo(item.method)} not allowed (use GET or HEAD)\n".encode()
        return Reply(405, body, headers=ALLOW)
    if item.has_body:
        return Reply(413, b"this server accepts no request body\n")
    path = item.path
    if path == "/metrics":
        try:
            return Reply(200, render_metrics(), CONTENT_TYPE_LATEST)
        except Exception:
            log.exception("collecting metrics failed")
            return Reply(500, b"collecting metrics failed; see the broker log\n")
    if path == "/healthz":
        return Reply(200, b"ok\n")
    if path == "/":
        return Reply(200, INDEX)
    return Reply(404, f"no such path {_echo(path)!r} (try /metrics, /healthz, /connections "
                      "or /subscriptions)\n".encode())


class _State(enum.Enum):
    WAITING = "waiting"  # for a request: none of it yet, or part of it
    IDLE = "idle"  # kept alive between requests, nothing received
    ANSWERING = "answering"  # rendering or sending a reply


@attrs.define(eq=False)
class _Slot:
    """One admitted connection, as the admission policy sees it."""

    scope: trio.CancelScope
    stream: trio.abc.Stream
    state: _State = _State.WAITING
    # When the current state began (trio clock).
    since: float = 0.0

    def enter(self, state: _State) -> None:
        self.state = state
        self.since = trio.current_time()


def _peer(stream: trio.abc.Stream) -> str:
    return peer_address(stream) or "?"


@attrs.define(eq=False)
class MetricsHTTP:
    """Serves HTTP connections: admission, per-connection loop, fault counting."""

    render: Callable[[], bytes]
    # Counts one protocol error ("metrics", reason); None counts nothing.
    count: Callable[[str, str], None] | None = None
    slots: set[_Slot] = attrs.Factory(set)
    # Connections closed to make room for a new one (idle or unfinished).
    evicted: int = 0
    # The access rules as configured now (a SIGHUP reload may change them).
    access: Callable[[], MetricsAccess] = MetricsAccess
    # Answers /connections and /subscriptions; None: not served (404).
    listing: Listing | None = None
    # The address the listener binds, for the "listing is off" answer.
    host: str = ""
    # Counts a request refused for its credentials (auth_failures{protocol="metrics"}).
    count_auth_failure: Callable[[str], None] | None = None

    def _fault(self, stream: trio.abc.Stream, fault: Fault, detail: str) -> None:
        if self.count is not None:
            self.count(PROTOCOL, fault.value)
        log.info("metrics client %s: %s (%s)", _peer(stream), detail, fault.value)

    def _victim(self) -> _Slot | None:
        """The slot a new connection may take, or None (all busy answering).

        Idle kept-alive connections first (their client reconnects when it
        needs to), then the one waiting longest for an unfinished request,
        then the one stuck longest handing over a reply (past ANSWER_GRACE).
        """
        now = trio.current_time()
        rank = {_State.IDLE: 0, _State.WAITING: 1, _State.ANSWERING: 2}
        candidates = [s for s in self.slots
                      if s.state is not _State.ANSWERING or now - s.since > ANSWER_GRACE]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (rank[s.state], s.since))

    async def handle(self, stream: trio.abc.Stream) -> None:
        """A new connection: admit it (evicting if full), serve it, close it."""
        try:
            if len(self.slots) >= MAX_CONNECTIONS:
                victim = self._victim()
                if victim is None:
                    self._fault(stream, Fault.REFUSED,
                                f"{MAX_CONNECTIONS} connections busy; refused with 503")
                    try:
                        with trio.move_on_after(SEND_TIMEOUT):
                            await stream.send_all(
                                ServerConnection().fail(503, "too many metrics connections"))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    return
                self._evict(victim)
            slot = _Slot(trio.CancelScope(), stream, since=trio.current_time())
            self.slots.add(slot)
            try:
                with slot.scope:
                    await self.serve_connection(stream, slot)
            except Exception:
                # A bug here must not take the listener (and the broker) down.
                log.exception("metrics connection failed")
            finally:
                self.slots.discard(slot)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await trio.aclose_forcefully(stream)

    def _evict(self, victim: _Slot) -> None:
        self.slots.discard(victim)
        victim.scope.cancel()
        self.evicted += 1
        held = trio.current_time() - victim.since
        why = f"closed to admit a new connection ({MAX_CONNECTIONS} in use)"
        if victim.state is _State.WAITING:
            self._fault(victim.stream, Fault.EVICTED,
                        f"no complete request after {held:.1f} s; {why}")
        elif victim.state is _State.ANSWERING:
            self._fault(victim.stream, Fault.SLOW_READER,
                        f"response not taken in {held:.1f} s; {why}")

    async def serve_connection(self, stream: trio.abc.Stream, slot: _Slot) -> None:
        """One HTTP connection: read requests, answer each, until close or timeout."""
        conn = ServerConnection()
        # The first request must be complete REQUEST_TIMEOUT after the opening.
        request_deadline: float | None = trio.current_time() + REQUEST_TIMEOUT
        idle_deadline = 0.0
        try:
            while True:
                item = conn.next_request()
                if item is None:
                    if conn.peer_closed:
                        return
                    if conn.buffered and request_deadline is None:
                        request_deadline = trio.current_time() + REQUEST_TIMEOUT
                        slot.enter(_State.WAITING)
                    deadline = request_deadline if request_deadline is not None else idle_deadline
                    data = None
                    with trio.move_on_at(deadline):
                        data = await stream.receive_some(RECV_SIZE)
                    if data is None:
                        await self._timed_out(stream, conn, request_deadline is not None)
                        return
                    conn.receive_data(data)
                    continue
                slot.enter(_State.ANSWERING)
                if isinstance(item, HTTPError):
                    self._fault(stream, item.fault, f"{item.status} {item.reason}")
                out = conn.send_reply(await self.respond(stream, item))
                try:
                    with trio.fail_after(SEND_TIMEOUT):
                        await stream.send_all(out)
                except trio.TooSlowError:
                    self._fault(stream, Fault.SLOW_READER,
                                f"did not read its response in {SEND_TIMEOUT:g} s; closed")
                    return
                if conn.closed:
                    return
                request_deadline = None
                idle_deadline = trio.current_time() + IDLE_TIMEOUT
                slot.enter(_State.IDLE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def respond(self, stream: trio.abc.Stream, item: Request | HTTPError) -> Reply:
        """The reply to one request: access rules, the listing, then :func:`answer`."""
        if (not isinstance(item, Request) or item.method not in ("GET", "HEAD")
                or item.has_body):
            return answer(item, self.render)
        path = item.path
        access = self.access()
        if path not in OPEN_PATHS and not access.allows(item.header("authorization")):
            if self.count_auth_failure is not None:
                self.count_auth_failure(PROTOCOL)
            given = "wrong" if item.header("authorization") else "no"
            log.info("metrics client %s: %s credentials for %s; 401",
                     _peer(stream), given, _echo(path))
            return Reply(401, f"{given} credentials: this listener needs "
                              f"{_schemes(access)}\n".encode(), headers=access.challenge())
        if path not in LISTING_PATHS or self.listing is None:
            return answer(item, self.render)
        if not access.listing_served:
            return Reply(403, f"{access.listing_off_reason(self.host)}\n".encode())
        try:
            if path == "/connections":
                body = await self.listing.connections_json(item.target)
            else:
                body = await self.listing.subscriptions_json(item.target)
        except BadQuery as exc:
            return Reply(400, f"{exc}\n".encode())
        except Exception:
            log.exception("listing %s failed", path)
            return Reply(500, b"listing failed; see the broker log\n")
        return Reply(200, body, JSON)

    async def _timed_out(self, stream: trio.abc.Stream, conn: ServerConnection,
                         in_request: bool) -> None:
        if not in_request:
            return  # idle keep-alive connection: close quietly, as HTTP servers do
        self._fault(stream, Fault.TIMEOUT,
                    f"no complete request within {REQUEST_TIMEOUT:g} s; closed")
        if conn.buffered:  # part of a request arrived: say why we close
            with trio.move_on_after(SEND_TIMEOUT):
                await stream.send_all(conn.fail(408, "request not completed in time"))


def _schemes(access: MetricsAccess) -> str:
    schemes = []
    if access.token is not None:
        schemes.append("Authorization: Bearer <token>")
    if access.username is not None:
        schemes.append("Authorization: Basic <user:password>")
    return " or ".join(schemes)


async def serve_metrics(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config
    router = ctx.router
    # Turn on the per-message bookkeeping only metrics need.
    if router.group_stats is None:
        router.group_stats = {}
    if router.latency is None:
        router.latency = RouteLatency()
    protocols: list[str] = [p for p in LISTENER_PROTOCOLS if p in ctx.services]
    protocols += sorted({f"bridge-{b.protocol}" for b in cfg.bridges})
    registry = build_registry(ctx, protocols, {PROTOCOL: [f.value for f in Fault]})
    allowed = tuple(g.encode() for g in cfg.metrics.groups)

    def render() -> bytes:
        return generate_latest(registry)

    host = cfg.metrics.host if cfg.metrics.host is not None else cfg.broker.host
    listeners = await open_listeners(host, cfg.metrics.port, cfg.metrics.tls_cert,
                                     cfg.metrics.tls_key, tls_ca=cfg.metrics.tls_ca,
                                     client_auth=cfg.metrics.tls_client_auth)
    def access() -> MetricsAccess:
        # Read per request from the running configuration: a SIGHUP reload
        # that changes the credentials applies to the next request.
        return MetricsAccess.from_section(ctx.config.metrics, is_loopback(host))

    rules = access()
    if not rules.listing_served:
        log.warning("metrics: %s; /metrics stays open", rules.listing_off_reason(host))
    server = MetricsHTTP(render, router.counters.protocol_error, access=access,
                         listing=Listing(router), host=host,
                         count_auth_failure=router.counters.auth_failure)
    # The broker's own accept loop: out of descriptors, it pauses and logs
    # once per interval (trio.serve_listeners would log a traceback each time).
    errors = AcceptErrorLog(PROTOCOL)

    def accept_failed() -> None:
        router.counters.accept_errors += 1

    async with trio.open_nursery() as nursery:
        for lst in listeners:
            nursery.start_soon(accept_loop, lst, server.handle, nursery, errors, accept_failed)
        task_status.started([("metrics", *listener_address(lst)) for lst in listeners])
        while True:
            await trio.sleep(PRUNE_INTERVAL)
            prune_group_stats(router.group_stats, allowed, cfg.metrics.top_groups)
