"""Chatter (Hat) communication: 1+m framing, SBS schemas and the connection state machine."""

from wire.chatter.connection import (
    CONVERSATION_TIMEOUT,
    PING,
    PONG,
    ChatterConnection,
    ChatterError,
    Conversation,
    Envelope,
    Message,
)
from wire.chatter.framing import FrameSplitter, FramingError, encode_frame
from wire.chatter.sbs import SbsError

__all__ = [
    "CONVERSATION_TIMEOUT",
    "PING",
    "PONG",
    "ChatterConnection",
    "ChatterError",
    "Conversation",
    "Envelope",
    "FrameSplitter",
    "FramingError",
    "Message",
    "SbsError",
    "encode_frame",
]
