"""What every trio client shares: dialling (TCP or TLS) and async iteration."""

from __future__ import annotations

import ssl
from typing import Any

import trio


async def open_stream(
    host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> trio.abc.Stream:
    """A TCP stream to host:port, wrapped in TLS when ``ssl_context`` is given."""
    if ssl_context is not None:
        return await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ssl_context)
    return await trio.open_tcp_stream(host, port)


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
