"""The ``metrics`` service: GET /metrics and /healthz on the broker's own trio loop.

HTTP/1.1 parsing is the sans-IO :mod:`wire.http`; :func:`answer` (pure)
maps a parsed request to response bytes; :func:`serve_metrics` is the thin
trio layer: accept, read with timeouts, write.  No thread: the scrape body
is rendered synchronously on the event loop (a few milliseconds; the
scrape is one client every few seconds).

Behaviour an operator can rely on:
- ``GET``/``HEAD /metrics``: Prometheus text format, ``CONTENT_TYPE_LATEST``.
- ``GET``/``HEAD /healthz``: ``200 ok`` while the broker runs.
- Other paths 404; other methods 405 with ``Allow: GET, HEAD``; requests with
  a body are answered (405 or 413) and the connection is closed.
- Malformed request 400, head over 8 KiB 431, HTTP/2+ 505: answered, closed.
- HTTP/1.1 connections stay open (Prometheus reuses them) unless the client
  sends ``Connection: close``; HTTP/1.0 connections close after one answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from broker.core.reasons import LISTENER_PROTOCOLS
from broker.observability.latency import RouteLatency
from broker.observability.metrics import build_registry, prune_group_stats
from broker.runtime.context import BrokerContext
from broker.runtime.transport import listener_address, open_listeners
from wire.http import HTTPError, Request, RequestReader, response

log = logging.getLogger(__name__)

# Concurrent HTTP connections.  Scrapers are few; the cap bounds the tasks
# and buffers an HTTP client can make the broker hold.  Excess connections
# get 503 and are closed.
MAX_CONNECTIONS = 32
# Seconds a kept-alive connection may sit idle between requests: longer than
# Prometheus' default 60 s scrape interval, so regular scrapes reuse it.
IDLE_TIMEOUT = 75.0
# Seconds from a request's first byte to its complete head (slow-loris guard).
REQUEST_TIMEOUT = 10.0
# Seconds to hand one response to a client that is not reading.
SEND_TIMEOUT = 10.0
RECV_SIZE = 8192
# How often the per-group table is pruned when nobody scrapes.
PRUNE_INTERVAL = 10.0

ALLOW = (("Allow", "GET, HEAD"),)
INDEX = b"Skan broker: /metrics (Prometheus text format), /healthz\n"


def answer(item: Request | HTTPError, render_metrics: Callable[[], bytes]) -> tuple[bytes, bool]:
    """Response bytes for one parsed request, and whether the connection stays open."""
    if isinstance(item, HTTPError):
        return response(item.status, f"{item.reason}\n".encode(), keep_alive=False), False
    keep = item.keep_alive and not item.has_body
    if item.method not in ("GET", "HEAD"):
        body = f"method {item.method} not allowed (use GET or HEAD)\n".encode()
        return response(405, body, keep_alive=keep, headers=ALLOW), keep
    if item.has_body:
        return response(413, b"this server accepts no request body\n", keep_alive=False), False
    head_only = item.method == "HEAD"
    path = item.path
    if path == "/metrics":
        try:
            body, ctype, status = render_metrics(), CONTENT_TYPE_LATEST, 200
        except Exception:
            log.exception("collecting metrics failed")
            body = b"collecting metrics failed; see the broker log\n"
            ctype, status = "text/plain; charset=utf-8", 500
    elif path == "/healthz":
        body, ctype, status = b"ok\n", "text/plain; charset=utf-8", 200
    elif path == "/":
        body, ctype, status = INDEX, "text/plain; charset=utf-8", 200
    else:
        body = f"no such path {path!r} (try /metrics or /healthz)\n".encode()
        ctype, status = "text/plain; charset=utf-8", 404
    return response(status, body, ctype, keep_alive=keep, head_only=head_only), keep


async def serve_connection(stream: trio.abc.Stream, render_metrics: Callable[[], bytes]) -> None:
    """One HTTP connection: read requests, answer each, until close or timeout."""
    reader = RequestReader()
    request_deadline: float | None = None
    try:
        while True:
            if reader.buffered:
                if request_deadline is None:
                    request_deadline = trio.current_time() + REQUEST_TIMEOUT
                deadline = request_deadline
            else:
                request_deadline = None
                deadline = trio.current_time() + IDLE_TIMEOUT
            data = b""
            with trio.move_on_at(deadline):
                data = await stream.receive_some(RECV_SIZE)
                if not data:
                    return
            if not data:
                if reader.buffered:
                    await _send(stream, answer(HTTPError(408, "request not completed in time"),
                                               render_metrics)[0])
                return
            for item in reader.feed(data):
                out, keep = answer(item, render_metrics)
                await _send(stream, out)
                if not keep:
                    return
                request_deadline = None
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await trio.aclose_forcefully(stream)


async def _send(stream: trio.abc.Stream, data: bytes) -> None:
    with trio.fail_after(SEND_TIMEOUT):
        await stream.send_all(data)


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
    registry = build_registry(ctx, protocols)
    allowed = tuple(g.encode() for g in cfg.metrics.groups)

    def render() -> bytes:
        return generate_latest(registry)

    listeners = await open_listeners(
        cfg.broker.host, cfg.metrics.port, cfg.metrics.tls_cert, cfg.metrics.tls_key
    )
    active = 0

    async def handle(stream: trio.abc.Stream) -> None:
        nonlocal active
        if active >= MAX_CONNECTIONS:
            try:
                await _send(stream, response(503, b"too many metrics connections\n",
                                             keep_alive=False))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                pass
            finally:
                await trio.aclose_forcefully(stream)
            return
        active += 1
        try:
            await serve_connection(stream, render)
        except trio.TooSlowError:
            log.info("metrics client did not read its response in %ss; closed", SEND_TIMEOUT)
        except Exception:
            log.exception("metrics connection failed")
        finally:
            active -= 1

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started([("metrics", *listener_address(lst)) for lst in listeners])
        while True:
            await trio.sleep(PRUNE_INTERVAL)
            prune_group_stats(router.group_stats, allowed, cfg.metrics.top_groups)
