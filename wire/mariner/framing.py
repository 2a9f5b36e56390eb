"""Mariner stream framing: the shared 1+m framing (:mod:`wire.lenprefix`).

``m`` must be 1 to 8 (the Mariner text and every Hat implementation).
"""

from __future__ import annotations

import functools

from wire.errors import FramingError
from wire.lenprefix import LengthPrefixSplitter
from wire.lenprefix import encode_frame as _encode_frame

__all__ = ["MAX_LEN_SIZE", "FrameSplitter", "FramingError", "encode_frame"]

# Largest m the Mariner text allows: 8 bytes of length.
MAX_LEN_SIZE = 8

encode_frame = functools.partial(_encode_frame, max_len_size=MAX_LEN_SIZE)


class FrameSplitter(LengthPrefixSplitter):
    __slots__ = ()
    protocol = "Mariner"
    min_len_size = 1
    max_len_size = MAX_LEN_SIZE
