"""What every trio client shares: dialling (TCP or TLS), keep-alive, async iteration.

The broker's listeners and bridges use the same keep-alive loop
(:func:`idle_pinger`); this module imports nothing from ``broker``.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ClassVar, Self

import trio

from wire.errors import RemoteProtocolError

# Where the clients look for a broker unless told otherwise (the broker's own default bind).
DEFAULT_HOST = "127.0.0.1"
# Seconds a client waits to establish TCP (and TLS) and then for the server's
# first answer (Skan getlname, Eventer MsgInitRes, Mariner pong).  A port that
# speaks another protocol is reported within this time instead of hanging.
CONNECT_TIMEOUT = 5.0


# A foreign protocol's bytes read as a length make numbers of hundreds of digits.
_LONG_NUMBER = re.compile(r"\d{16,}")
# Longest peer-derived text quoted in one line.
MAX_REASON = 200


class AnswersHTTP(RemoteProtocolError):
    """The peer answered in HTTP (a client pointed at the broker's metrics port)."""

    def __init__(self, protocol: str, default_port: int) -> None:
        super().__init__(f"it answers HTTP, not {protocol} (the broker's metrics port? "
                         f"{protocol}'s default port is {default_port})")


def tidy_reason(text: str) -> str:
    """A decoder's or peer's reason fit for one line: huge numbers summarised, length capped."""
    text = _LONG_NUMBER.sub(lambda m: f"a {len(m.group())}-digit number", text)
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


async def open_stream(
    host: str, port: int, ssl_context: ssl.SSLContext | None = None,
    timeout: float = CONNECT_TIMEOUT,
) -> trio.abc.Stream:
    """A TCP stream to host:port, wrapped in TLS when ``ssl_context`` is given.

    Raises :class:`TimeoutError` (an OSError) naming host:port when TCP does
    not connect within ``timeout`` seconds.
    """
    with trio.move_on_after(timeout):
        if ssl_context is not None:
            return await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ssl_context)
        return await trio.open_tcp_stream(host, port)
    raise TimeoutError(f"no TCP connection to {host}:{port} within {timeout:g}s")


class Dialling:
    """What every client's ``connect`` is: dial, then run the client over the stream.

    A client class names its ``default_port`` and defines :meth:`over` (run
    a client over an open stream, which it closes when the block exits);
    :meth:`connect` is the one way all of them (Skan, Skan over HSP, HSP,
    Eventer, Mariner) dial: TCP, or TLS with ``ssl_context``, within
    ``connect_timeout`` seconds.
    """

    default_port: ClassVar[int]

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int | None = None,
        *args: Any,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        **kwargs: Any,
    ) -> AsyncIterator[Self]:
        """Dial ``host:port`` (the class's ``default_port`` when None) and run
        the client until the block exits.  Other arguments go to :meth:`over`,
        with ``target="host:port"`` to name the peer in errors; raises
        :class:`TimeoutError` when TCP does not connect in time."""
        if port is None:
            port = cls.default_port
        stream = await open_stream(host, port, ssl_context, connect_timeout)
        async with cls.over(stream, *args, target=f"{host}:{port}", **kwargs) as client:
            yield client

    @classmethod
    def over(cls, stream: trio.abc.Stream, *args: Any, target: str,
             **kwargs: Any) -> AbstractAsyncContextManager[Self]:  # pragma: no cover
        """Run a client over ``stream`` (closed when the block exits)."""
        raise NotImplementedError


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


def env_token(token: str | None) -> str | None:
    """``--token`` if given, else ``$SKAN_TOKEN`` (read after parsing, so a
    help text never shows the secret as a default)."""
    return token if token is not None else os.environ.get("SKAN_TOKEN")


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
