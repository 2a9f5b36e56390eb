"""What every trio client shares: dialling (TCP or TLS), keep-alive, async iteration.

The broker's listeners and bridges use the same keep-alive loop
(:func:`idle_pinger`); this module imports nothing from ``broker``.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio


async def open_stream(
    host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> trio.abc.Stream:
    """A TCP stream to host:port, wrapped in TLS when ``ssl_context`` is given."""
    if ssl_context is not None:
        return await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ssl_context)
    return await trio.open_tcp_stream(host, port)


async def idle_pinger(
    last_rx: Callable[[], float],
    ping: Callable[[], Awaitable[object]],
    delay: float,
    timeout: float,
) -> None:
    """Keep-alive: ping a peer idle for ``delay`` seconds; return once it stays silent.

    ``last_rx()`` is the trio time of the last bytes received from the peer
    (any bytes count as liveness, not only the answer to the ping).  Returns
    when nothing arrived within ``timeout`` seconds after a ping: the caller
    decides what a dead peer means (close, fail, reconnect).  The one
    keep-alive loop of every client, listener and bridge.
    """
    while True:
        idle_until = last_rx() + delay
        now = trio.current_time()
        if now < idle_until:
            await trio.sleep(idle_until - now)
            continue
        await ping()
        await trio.sleep(timeout)
        if last_rx() < now:
            return


def add_credential_args(p: argparse.ArgumentParser) -> None:
    """``--token`` (default ``$SKAN_TOKEN``) and a TLS client certificate."""
    p.add_argument("--token", help="credential for the broker's [[users]] "
                   "(default: the SKAN_TOKEN environment variable)")
    p.add_argument("--tls-cert", help="client certificate (PEM) to present; implies --tls")
    p.add_argument("--tls-key", help="private key of --tls-cert (if not in the same file)")


def env_token(token: str | None) -> str | None:
    """``--token`` if given, else ``$SKAN_TOKEN`` (read after parsing, so a
    help text never shows the secret as a default)."""
    return token if token is not None else os.environ.get("SKAN_TOKEN")


def tls_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client TLS context of ``--tls``/``--tls-ca``/``--tls-cert``/``--tls-key``."""
    if not (args.tls or args.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=args.tls_ca)
    if args.tls_cert:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    return ctx


class ReceiveIterator:
    """``async for item in client`` over ``client.receive()``, ending at end of input."""

    async def receive(self) -> Any:  # pragma: no cover - provided by the client
        raise NotImplementedError

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
