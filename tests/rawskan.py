"""A deliberately dumb Skan peer for tests: raw bytes out, decoded frames in."""

from __future__ import annotations

from typing import Any

import trio

from wire.skan import FrameSplitter, decode, encode_frame


class RawSkan:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.splitter = FrameSplitter(64 << 20)
        self.frames: list[bytes] = []

    @classmethod
    async def open(cls, addr: tuple[str, int]) -> RawSkan:
        return cls(await trio.open_tcp_stream(*addr))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, message: dict[str, Any]) -> None:
        await self.stream.send_all(encode_frame(message))

    async def frame(self, timeout: float = 5.0) -> bytes:
        """Next raw frame (length prefix included); raises EOFError when the broker closed."""
        with trio.fail_after(timeout):
            while not self.frames:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("connection closed by the broker")
                self.frames.extend(self.splitter.receive_data(data))
        return self.frames.pop(0)

    async def message(self, timeout: float = 5.0) -> dict[bytes, Any]:
        return decode((await self.frame(timeout))[4:])

    async def getlname(self) -> bytes:
        await self.send({"type": "getlname"})
        return (await self.message())[b"lname"]

    async def expect_closed(self, timeout: float = 5.0) -> list[dict[bytes, Any]]:
        """Read until EOF; return the messages that came before it."""
        got = []
        try:
            while True:
                got.append(await self.message(timeout))
        except (EOFError, trio.BrokenResourceError):
            return got

    async def expect_silence(self, seconds: float = 0.3) -> None:
        with trio.move_on_after(seconds):
            frame = await self.frame(seconds + 1)
            raise AssertionError(f"unexpected frame {decode(frame[4:])!r}")

    async def aclose(self) -> None:
        await self.stream.aclose()
