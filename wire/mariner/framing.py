"""Mariner stream framing: a 1+m byte header (m, then the body length k in m big-endian bytes).

Sans-IO: feed received bytes, get complete message bodies back.  ``m`` must
be 1 to 8 (the Mariner text and every Hat implementation); a longer-than-
needed ``m`` is accepted, the encoder always uses the smallest.  ``k`` is
checked against ``max_message`` as soon as the header is complete, so a
header announcing an exabyte is refused before any of it is buffered.
"""

from __future__ import annotations

# Largest m the Mariner text allows: 8 bytes of length.
MAX_LEN_SIZE = 8


class FramingError(ValueError):
    """The byte stream cannot be trusted any more; close the connection."""


def encode_frame(body: bytes) -> bytes:
    """Prefix one message body with its 1+m header (m as small as possible)."""
    k = len(body)
    m = max(1, (k.bit_length() + 7) // 8)
    if m > MAX_LEN_SIZE:  # pragma: no cover - 2**64 bytes cannot exist in memory
        raise FramingError(f"a message of {k} bytes does not fit an 8-byte length")
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
        while pos < size:
            m = buf[pos]
            if not 1 <= m <= MAX_LEN_SIZE:
                self._buf = b""
                raise FramingError(
                    f"bad Mariner header: length size m={m} (must be 1 to {MAX_LEN_SIZE})"
                )
            start = pos + 1 + m
            if start > size:
                break
            k = int.from_bytes(buf[pos + 1 : start], "big")
            if k > self.max_message:
                self._buf = b""
                raise FramingError(
                    f"message of {k} bytes exceeds the limit of {self.max_message} bytes"
                )
            stop = start + k
            if stop > size:
                break
            bodies.append(buf[start:stop])
            pos = stop
        self._buf = buf[pos:] if pos < size else b""
        return bodies
