"""Chatter (Hat) communication: 1+m framing, SBS schemas and the connection state machine."""

from wire.chatter.connection import (
    CONVERSATION_TIMEOUT,
    PING,
    PONG,
    ChatterConnection,
    Conversation,
    Envelope,
    Message,
)
from wire.chatter.framing import FrameSplitter, encode_frame
from wire.chatter.sbs import SbsError
from wire.errors import FramingError, ProtocolError, RemoteProtocolError

__all__ = [
    "CONVERSATION_TIMEOUT",
    "PING",
    "PONG",
    "ChatterConnection",
    "Conversation",
    "Envelope",
    "FrameSplitter",
    "FramingError",
    "Message",
    "ProtocolError",
    "RemoteProtocolError",
    "SbsError",
    "encode_frame",
]
