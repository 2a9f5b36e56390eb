"""Skan wire format: codec (encode/decode/routing header) and stream framing."""

from wire.errors import FramingError, LocalProtocolError, MalformedError, ProtocolError
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
from wire.skan.framing import FrameSplitter, looks_like_skan

__all__ = [
    "MAGIC",
    "FrameSplitter",
    "FramingError",
    "LocalProtocolError",
    "MalformedError",
    "Nested",
    "ProtocolError",
    "SkanError",
    "decode",
    "decode_header",
    "encode",
    "encode_frame",
    "encode_item",
    "frame",
    "item_bytes",
    "looks_like_skan",
]
