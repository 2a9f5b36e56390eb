"""A deliberately dumb Mariner peer for tests: raw bytes out, decoded JSON messages in."""

from __future__ import annotations

import json
from typing import Any

import trio

from wire.mariner import FrameSplitter, encode_frame


class RawMariner:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.splitter = FrameSplitter(64 << 20)
        self.bodies: list[bytes] = []

    @classmethod
    async def open(cls, addr: tuple[str, int]) -> RawMariner:
        return cls(await trio.open_tcp_stream(*addr))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, message: Any) -> None:
        await self.stream.send_all(encode_frame(json.dumps(message).encode()))

    async def init(self, client_id: str = "raw", token: str | None = None,
                   last_event_id: dict[str, int] | None = None,
                   subscriptions: list[list[str]] | None = None) -> None:
        await self.send({"type": "init", "client_id": client_id, "client_token": token,
                         "last_event_id": last_event_id,
                         "subscriptions": subscriptions if subscriptions is not None else []})

    async def message(self, timeout: float = 5.0) -> Any:
        """Next decoded message; raises EOFError when the broker closed."""
        with trio.fail_after(timeout):
            while not self.bodies:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("connection closed by the broker")
                self.bodies.extend(self.splitter.receive_data(data))
        return json.loads(self.bodies.pop(0))

    async def expect_closed(self, timeout: float = 5.0) -> list[Any]:
        """Read until EOF; return the messages that came before it."""
        got = []
        try:
            while True:
                got.append(await self.message(timeout))
        except (EOFError, trio.BrokenResourceError):
            return got

    async def aclose(self) -> None:
        await self.stream.aclose()
