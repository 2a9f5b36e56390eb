"""Chatter stream framing: a 1+m byte header (m, then the body length k in m big-endian bytes).

Sans-IO: feed received bytes, get complete message bodies back.  The
Chatter text allows m from 0 to 255; every m is accepted (a longer-than-
needed length is harmless) and the encoder always uses the smallest m >= 1,
as the Hat libraries do.  k is checked against ``max_message`` as soon as
the header is complete, so a header announcing an exabyte is refused before
any of its body is buffered.
"""

from __future__ import annotations


class FramingError(ValueError):
    """The byte stream cannot be trusted any more; close the connection."""


def encode_frame(body: bytes) -> bytes:
    """Prefix one message body with its 1+m header (m as small as possible, at least 1)."""
    k = len(body)
    m = max(1, (k.bit_length() + 7) // 8)
    return bytes((m,)) + k.to_bytes(m, "big") + body


class FrameSplitter:
    """Split a byte stream into message bodies (headers stripped)."""

    __slots__ = ("_buf", "max_message")

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._buf = b""

    @property
    def buffered(self) -> int:
        """Bytes held for a message that is not complete yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        bodies: list[bytes] = []
        pos = 0
        size = len(buf)
        limit = self.max_message
        while pos < size:
            m = buf[pos]
            start = pos + 1 + m
            if start > size:
                break
            k = int.from_bytes(buf[pos + 1 : start], "big")
            if k > limit:
                self._buf = b""
                raise FramingError(
                    f"message of {k} bytes exceeds the limit of {limit} bytes"
                )
            stop = start + k
            if stop > size:
                break
            bodies.append(buf[start:stop])
            pos = stop
        self._buf = buf[pos:] if pos < size else b""
        return bodies
