"""Skan wire format: codec (encode/decode/routing header) and stream framing."""

from wire.skan.codec import (
    MAGIC,
    Nested,
    SkanError,
    decode,
    decode_header,
    encode,
    encode_frame,
    encode_item,
    frame,
    item_bytes,
)
from wire.skan.framing import FrameError, FrameSplitter

__all__ = [
    "MAGIC",
    "FrameError",
    "FrameSplitter",
    "Nested",
    "SkanError",
    "decode",
    "decode_header",
    "encode",
    "encode_frame",
    "encode_item",
    "frame",
    "item_bytes",
]
