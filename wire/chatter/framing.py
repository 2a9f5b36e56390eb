"""Chatter stream framing: the shared 1+m framing (:mod:`wire.lenprefix`).

The Chatter text allows m from 0 to 255; every m is accepted.
"""

from __future__ import annotations

from wire.errors import FramingError
from wire.lenprefix import LengthPrefixSplitter, encode_frame

__all__ = ["FrameSplitter", "FramingError", "encode_frame"]


class FrameSplitter(LengthPrefixSplitter):
    __slots__ = ()
    protocol = "Chatter"
    min_len_size = 0
    max_len_size = 255
