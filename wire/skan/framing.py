"""Incremental splitter for the Skan TCP stream: 4-byte big-endian length, then the message.

Sans-IO: feed received bytes, get complete frames back.  The length is
checked against ``max_frame`` as soon as the 4-byte prefix is seen, so a
header announcing 2 GiB is refused before a single byte of it is buffered.
"""

from __future__ import annotations

import contextlib

from wire.skan.codec import PURE_PYTHON

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
        if type(buf) is not bytes:
            buf = bytes(buf)
        frames, pos, bad = _split(buf, self.max_frame)
        if bad >= 0:
            self._buf = b""
            limit = self.max_frame
            if bad > limit:
                raise FrameError(f"frame of {bad} bytes exceeds the limit of {limit} bytes")
            raise FrameError(f"frame of {bad} bytes is shorter than the 4-byte magic")
        self._buf = buf[pos:] if pos < len(buf) else b""
        return frames


def split(buf: bytes, max_frame: int) -> tuple[list[bytes], int, int]:
    """The complete frames at the start of ``buf``: (frames, bytes consumed, bad length).

    ``bad length`` is -1, or the announced length of the first frame that is
    over ``max_frame`` or shorter than the magic (the stream is then unusable).
    The reference for the compiled ``_speedups.split``.
    """
    frames: list[bytes] = []
    pos = 0
    size = len(buf)
    while size - pos >= 4:
        n = int.from_bytes(buf[pos : pos + 4], "big")
        if n > max_frame or n < MAGIC_LEN:
            return frames, pos, n
        stop = pos + 4 + n
        if stop > size:
            break
        frames.append(buf[pos:stop])
        pos = stop
    return frames, pos, -1


_split = split
if not PURE_PYTHON:
    with contextlib.suppress(ImportError):  # not built: the reference serves
        from wire.skan._speedups import split as _split
