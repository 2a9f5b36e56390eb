"""Incremental splitter for the Skan TCP stream: 4-byte big-endian length, then the message.

Sans-IO: ``receive_data(bytes)`` returns the complete frames.  The length is
checked against ``max_frame`` as soon as the 4-byte prefix is seen, so a
header announcing 2 GiB is refused before a single byte of it is buffered.
Reassembly is linear in the bytes received (:mod:`wire.buffer`).
"""

from __future__ import annotations

import contextlib

from wire.buffer import Reassembler
from wire.errors import FramingError
from wire.skan.codec import MAGIC, PURE_PYTHON

MAGIC_LEN = 4


def looks_like_skan(data: bytes) -> bool:
    """Whether the first bytes a peer sent look like a Skan frame (length, then
    the ``Skan`` magic), for listeners of other protocols that want to tell a
    Skan client it dialled the wrong port."""
    return len(data) >= 4 + MAGIC_LEN and data[4:4 + MAGIC_LEN] == MAGIC and data[0] == 0


class FrameSplitter(Reassembler):
    """Split a byte stream into frames.

    ``receive_data(data)`` returns a list of complete frames, each a ``bytes``
    object holding the 4-byte prefix and the message, ready to forward
    byte-for-byte.  Raises :class:`~wire.errors.FramingError` for a length
    over ``max_frame`` or shorter than the magic.
    """

    __slots__ = ("max_frame",)

    def __init__(self, max_frame: int) -> None:
        super().__init__()
        self.max_frame = max_frame

    def receive_data(self, data: bytes) -> list[bytes]:
        rx = self._rx
        first = None
        pos = 0
        if rx.held:
            first, data, pos = rx.resume(data)
        if type(data) is not bytes:
            data = bytes(data)
        frames, pos, bad, need = split_frames(data, pos, self.max_frame)
        if bad >= 0:
            rx.clear()
            if bad < MAGIC_LEN:
                raise FramingError(f"frame of {bad} bytes is shorter than the 4-byte magic")
            raise FramingError(f"frame of {bad} bytes exceeds the limit of {self.max_frame} bytes")
        if first is not None:
            frames.insert(0, first)
        if pos < len(data):
            rx.keep(data, pos, need)
        return frames


def split(data: bytes, pos: int, max_frame: int) -> tuple[list[bytes], int, int, int]:
    """Scan ``data`` from ``pos``: ``(frames, pos, bad, need)``.

    ``frames`` are the complete frames (prefix included) and ``pos`` where the
    rest begins; ``bad`` is -1, or the announced length of the first frame
    that is over ``max_frame`` or shorter than the magic (the stream is then
    unusable); ``need`` is the whole length of the incomplete frame at
    ``pos`` once its prefix is in, else 0.  This is every Skan connection's
    receive path: the reference for the compiled ``_speedups.split``.
    """
    frames: list[bytes] = []
    size = len(data)
    while size - pos >= 4:
        n = int.from_bytes(data[pos : pos + 4], "big")
        if n > max_frame or n < MAGIC_LEN:
            return frames, pos, n, 0
        stop = pos + 4 + n
        if stop > size:
            return frames, pos, -1, 4 + n
        frames.append(data[pos:stop])
        pos = stop
    return frames, pos, -1, 0


# split_frames: the fastest available implementation of split() (the
# compiled one when built), for every caller that scans a buffer of frames.
split_frames = split
if not PURE_PYTHON:
    with contextlib.suppress(ImportError):  # not built: the reference serves
        from wire.skan._codec_speedups import split as split_frames
