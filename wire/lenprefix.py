"""The 1+m length-prefixed framing shared by Chatter and Mariner.

A frame is one byte m, then the body length k in m big-endian bytes, then
the body.  Sans-IO: ``receive_data(bytes)`` returns the complete bodies.  A
longer-than-needed m is accepted and the encoder always uses the smallest
m >= 1, as the Hat libraries do.  k is checked against ``max_message`` as
soon as the header is complete, so a header announcing an exabyte is
refused before any of its body is buffered.  Each protocol sets the largest
m it allows (Chatter: 255, Mariner: 8).  Reassembly is linear in the bytes
received (:mod:`wire.buffer`).
"""

from __future__ import annotations

from wire.buffer import Reassembler
from wire.errors import FramingError, LocalProtocolError


def encode_frame(body: bytes, max_len_size: int = 255) -> bytes:
    """Prefix one message body with its 1+m header (m as small as possible, at least 1)."""
    k = len(body)
    m = max(1, (k.bit_length() + 7) // 8)
    if m > max_len_size:  # pragma: no cover - such a body cannot exist in memory
        raise LocalProtocolError(
            f"a message of {k} bytes does not fit a {max_len_size}-byte length"
        )
    return bytes((m,)) + k.to_bytes(m, "big") + body


class LengthPrefixSplitter(Reassembler):
    """Split a 1+m framed byte stream into message bodies (headers stripped)."""

    __slots__ = ("max_message",)

    # Set by each protocol's subclass.
    protocol = "1+m"
    min_len_size = 0
    max_len_size = 255

    def __init__(self, max_message: int) -> None:
        super().__init__()
        self.max_message = max_message

    def _measure(self, buf: bytes, pos: int, size: int) -> int:
        m = buf[pos]
        if not self.min_len_size <= m <= self.max_len_size:
            raise FramingError(
                f"bad {self.protocol} header: length size m={m} "
                f"(must be {self.min_len_size} to {self.max_len_size})"
            )
        start = pos + 1 + m
        if start > size:
            return -1
        k = int.from_bytes(buf[pos + 1 : start], "big")
        if k > self.max_message:
            raise FramingError(
                f"message of {k} bytes exceeds the limit of {self.max_message} bytes"
            )
        return 1 + m + k

    def receive_data(self, data: bytes) -> list[bytes]:
        """The bodies (headers stripped) of the messages ``data`` completes."""
        bodies = []
        for buf, start, stop in self._rx.messages(data, self._measure):
            bodies.append(buf[start + 1 + buf[start] : stop])
        return bodies
