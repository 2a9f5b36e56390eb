"""Injected sends: the header built alongside the frame is exactly what decoding it gives."""

from __future__ import annotations

import pytest

from broker.core.inject import build_send, route_injected
from broker.core.router import NORMAL, Endpoint, Routed, Router
from wire.skan import Nested, decode, decode_header, item_bytes


def _same(a: object, b: object) -> bool:
    if isinstance(a, Nested) and isinstance(b, Nested):
        return (a.type, a.start, a.stop) == (b.type, b.start, b.stop)
    return a == b


@pytest.mark.parametrize("msg", [
    b"text",
    None,
    b"",
    b"x" * 300,  # 16-bit length
    b"y" * 70_000,  # 32-bit length
    {b"a": b"1", b"b": [b"2", None, {b"c": b"d"}]},
    [b"x" * 300, [], {}],
    {b"k": b"z" * 70_000},
])
def test_header_equals_decoding_the_frame(msg):
    message = build_send(b"lname-1", b"g", b"i/1", 7, msg, {b"payload-type": b"t"})
    frame = message.frame
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    decoded = decode_header(frame, 4)
    assert list(message.header) == list(decoded)
    for tag, value in decoded.items():
        assert _same(message.header[tag], value), tag
    assert item_bytes(frame, message.header, b"msg") == decode(frame[4:])[b"msg"]
    assert message.header[b"from"] == b"lname-1"
    assert message.header[b"to"] == b"*"
    assert message.header[b"seq"] == b"7"


class Sink(Endpoint):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[Routed] = []

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(routed)


def test_an_injected_send_is_routed_as_the_endpoints_own():
    router = Router()
    source, sink = Sink(), Sink()
    router.attach(source)
    router.attach(sink)
    router.subscribe(sink, b"g", b"*", NORMAL)
    message = build_send(source.lname, b"g", b"i", 1, b"hello")
    routed = route_injected(router, source, message)
    assert sink.got == [routed] and source.got == []
    assert routed.frame is message.frame and routed.sender is source
