"""A deliberately dumb HSP peer for tests: raw bytes out, decoded commands in, no state checks."""

from __future__ import annotations

from typing import Any

import trio

from wire.hsp import Data, DataAck, Decoder, Event, encode
from wire.skan import decode, encode_frame
from wire.skan import encode as skan_encode


class RawHSP:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.decoder = Decoder(64 << 20)
        self.events: list[Event] = []
        self._mid = 100

    @classmethod
    async def open(cls, addr: tuple[str, int]) -> RawHSP:
        return cls(await trio.open_tcp_stream(*addr))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, event: Event) -> None:
        await self.stream.send_all(encode(event))

    async def data(self, message: dict[str, Any] | bytes, type: int = 1) -> None:
        """DATA carrying a Skan message (dict) or raw payload bytes."""
        payload = skan_encode(message) if isinstance(message, dict) else message
        await self.send(Data.make(type, payload))

    async def data_ack(self, message: dict[str, Any] | bytes, type: int = 1) -> int:
        """DATA_ACK with a fresh MessageID; returns the id."""
        self._mid += 1
        payload = skan_encode(message) if isinstance(message, dict) else message
        await self.send(DataAck.make(self._mid, type, payload))
        return self._mid

    async def event(self, timeout: float = 5.0) -> Event:
        """Next command from the broker; raises EOFError when the broker closed."""
        with trio.fail_after(timeout):
            while not self.events:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    raise EOFError("connection closed by the broker")
                self.events.extend(self.decoder.receive_data(data))
        return self.events.pop(0)

    async def events_n(self, n: int, timeout: float = 5.0) -> list[Event]:
        return [await self.event(timeout) for _ in range(n)]

    @staticmethod
    def skan(event: Event) -> dict[bytes, Any]:
        """The Skan message inside a DATA Type 1 from the broker."""
        assert type(event) is Data and event.type == 1, event
        return decode(event.payload)

    async def getlname(self) -> bytes:
        await self.data({"type": "getlname"})
        return self.skan(await self.event())[b"lname"]

    async def expect_closed(self, timeout: float = 5.0) -> list[Event]:
        """Read until EOF; return the commands that came before it."""
        got = []
        try:
            while True:
                got.append(await self.event(timeout))
        except EOFError:
            return got

    async def expect_silence(self, seconds: float = 0.3) -> None:
        with trio.move_on_after(seconds):
            ev = await self.event(seconds + 1)
            raise AssertionError(f"unexpected command {ev!r}")

    async def aclose(self) -> None:
        await self.stream.aclose()


def skan_frame(message: dict[str, Any]) -> bytes:
    return encode_frame(message)
