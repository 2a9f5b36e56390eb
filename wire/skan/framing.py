"""Incremental splitter for the Skan TCP stream: 4-byte big-endian length, then the message.

Sans-IO: feed received bytes, get complete frames back.  The length is
checked against ``max_frame`` as soon as the 4-byte prefix is seen, so a
header announcing 2 GiB is refused before a single byte of it is buffered.
"""

from __future__ import annotations

MAGIC_LEN = 4


class FrameError(ValueError):
    """The byte stream cannot be trusted any more (bad length); close the connection."""


class FrameSplitter:
    """Split a byte stream into frames.

    ``feed(data)`` returns a list of complete frames, each a ``bytes`` object
    holding the 4-byte prefix and the message, ready to forward byte-for-byte.
    """

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = b""

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        frames: list[bytes] = []
        pos = 0
        size = len(buf)
        max_frame = self.max_frame
        while size - pos >= 4:
            n = int.from_bytes(buf[pos : pos + 4], "big")
            if n > max_frame:
                self._buf = b""
                raise FrameError(f"frame of {n} bytes exceeds the limit of {max_frame} bytes")
            if n < MAGIC_LEN:
                self._buf = b""
                raise FrameError(f"frame of {n} bytes is shorter than the 4-byte magic")
            stop = pos + 4 + n
            if stop > size:
                break
            frames.append(buf[pos:stop])
            pos = stop
        self._buf = buf[pos:] if pos < size else b""
        return frames
