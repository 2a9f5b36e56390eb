"""The 1+m length-prefixed framing shared by Chatter and Mariner.

A frame is one byte m, then the body length k in m big-endian bytes, then
the body.  Sans-IO: feed received bytes, get complete bodies back.  A
longer-than-needed m is accepted and the encoder always uses the smallest
m >= 1, as the Hat libraries do.  k is checked against ``max_message`` as
soon as the header is complete, so a header announcing an exabyte is
refused before any of its body is buffered.  Each protocol sets the largest
m it allows (Chatter: 255, Mariner: 8).
"""

from __future__ import annotations


class FramingError(ValueError):
    """The byte stream cannot be trusted any more; close the connection."""


def encode_frame(body: bytes, max_len_size: int = 255) -> bytes:
    """Prefix one message body with its 1+m header (m as small as possible, at least 1)."""
    k = len(body)
    m = max(1, (k.bit_length() + 7) // 8)
    if m > max_len_size:  # pragma: no cover - such a body cannot exist in memory
        raise FramingError(f"a message of {k} bytes does not fit a {max_len_size}-byte length")
    return bytes((m,)) + k.to_bytes(m, "big") + body


class LengthPrefixSplitter:
    """Split a 1+m framed byte stream into message bodies (headers stripped)."""

    __slots__ = ("_buf", "max_message")

    # Set by each protocol's subclass.
    protocol = "1+m"
    min_len_size = 0
    max_len_size = 255

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
        lo, hi = self.min_len_size, self.max_len_size
        while pos < size:
            m = buf[pos]
            if not lo <= m <= hi:
                self._buf = b""
                raise FramingError(
                    f"bad {self.protocol} header: length size m={m} (must be {lo} to {hi})"
                )
            start = pos + 1 + m
            if start > size:
                break
            k = int.from_bytes(buf[pos + 1 : start], "big")
            if k > limit:
                self._buf = b""
                raise FramingError(f"message of {k} bytes exceeds the limit of {limit} bytes")
            stop = start + k
            if stop > size:
                break
            bodies.append(buf[start:stop])
            pos = stop
        self._buf = buf[pos:] if pos < size else b""
        return bodies
