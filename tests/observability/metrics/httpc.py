"""A small raw HTTP/1.1 client for tests: exact bytes out, parsed responses in."""

from __future__ import annotations

import ssl

import attrs
import trio
from prometheus_client.parser import text_string_to_metric_families


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class RawHTTP:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def open(cls, addr: tuple[str, int], ssl_context: ssl.SSLContext | None = None
                   ) -> RawHTTP:
        if ssl_context is not None:
            return cls(await trio.open_ssl_over_tcp_stream(*addr, ssl_context=ssl_context))
        return cls(await trio.open_tcp_stream(*addr))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buf += data
        return bool(data)

    async def response(self, *, head: bool = False, timeout: float = 10.0) -> Response:
        """Read one response; ``head`` for answers to HEAD (Content-Length but no body)."""
        with trio.fail_after(timeout):
            while b"\r\n\r\n" not in self.buf:
                if not await self._fill():
                    raise EOFError("connection closed before a response")
            raw, self.buf = self.buf.split(b"\r\n\r\n", 1)
            lines = raw.decode("ascii").split("\r\n")
            version, status, _ = lines[0].split(" ", 2)
            assert version == "HTTP/1.1"
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = 0 if head else int(headers["content-length"])
            while len(self.buf) < length:
                if not await self._fill():
                    raise EOFError("connection closed inside a body")
            body, self.buf = self.buf[:length], self.buf[length:]
        return Response(int(status), headers, body)

    async def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """True once the server closes (and sent nothing more)."""
        with trio.fail_after(timeout):
            try:
                while await self._fill():
                    pass
            except trio.BrokenResourceError:
                pass
        return self.buf == b""

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


async def get(addr: tuple[str, int], path: str, method: str = "GET") -> Response:
    conn = await RawHTTP.open(addr)
    try:
        await conn.send(f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
                        .encode())
        return await conn.response(head=method == "HEAD")
    finally:
        await conn.aclose()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def scrape(addr: tuple[str, int]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    resp = await get(addr, "/metrics")
    assert resp.status == 200
    return samples(resp.body.decode())


def value(data: dict, name: str, **labels: str) -> float:
    return data[(name, frozenset(labels.items()))]
