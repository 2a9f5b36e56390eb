"""A raw NATS client for the attacker tests: any subject, any header, any bytes
(wire/nats's codec, a plain trio TCP stream, no broker code)."""

from __future__ import annotations

import json
import struct

import trio

from wire import nats


class RawNats:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = nats.NatsConnection()
        self.conn.max_payload = 64 * 1024 * 1024
        self.info: dict = {}
        self.msgs: list[nats.Msg] = []
        self.errors: list[str] = []

    @classmethod
    async def open(cls, url: str, **options: object) -> RawNats:
        host, port = url.removeprefix("nats://").split(":")
        client = cls(await trio.open_tcp_stream(host, int(port)))
        while not client.info:
            for ev in client.conn.receive_data(await client.stream.receive_some(65536)):
                if isinstance(ev, nats.Info):
                    client.info = ev.fields
        fields = {"verbose": False, "pedantic": False, "headers": True, "echo": False,
                  "protocol": 1, **options}
        await client.stream.send_all(b"CONNECT " + json.dumps(fields).encode() + b"\r\n")
        await client.flush()
        return client

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def flush(self, timeout: float = 10.0) -> None:
        """PING, and read until PONG: NATS has processed everything sent before."""
        await self.stream.send_all(nats.PING)
        with trio.fail_after(timeout):
            while True:
                data = await self.stream.receive_some(1 << 20)
                if not data:
                    raise ConnectionError("NATS closed the connection: " + "; ".join(self.errors))
                done = False
                for ev in self.conn.receive_data(data):
                    if isinstance(ev, nats.Pong):
                        done = True
                    elif isinstance(ev, nats.Ping):
                        await self.stream.send_all(nats.PONG)
                    elif isinstance(ev, nats.Msg):
                        self.msgs.append(ev)
                    elif isinstance(ev, nats.Err):
                        self.errors.append(ev.message)
                if done:
                    return

    async def collect(self, seconds: float) -> None:
        """Read messages for ``seconds``."""
        with trio.move_on_after(seconds):
            while True:
                await self.flush()
                await trio.sleep(0.02)

    async def aclose(self) -> None:
        await self.stream.aclose()


def run(subject: bytes, server: int, session: int, frames: list[bytes], claim: bytes = b"*",
        first: int = 1, stamp: float = 1.7e9) -> bytes:
    """An HPUB of a well-formed run (as broker ``server`` would write it)."""
    block = b"NATS/1.0\r\nSkan-Run: %d %d %d %d %s\r\n\r\n" % (server, session, first,
                                                             len(frames), claim)
    stamps = struct.pack(f"<{len(frames)}d", *([stamp] * len(frames)))
    return nats.hpub(subject, block, stamps + b"".join(frames))
