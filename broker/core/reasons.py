"""Fixed vocabularies: protocols, close reasons, protocol-error kinds, drop reasons.

Each value becomes a metric label (``skan_connections_closed_total{reason}``,
``skan_protocol_errors_total{kind}``, ``skan_dropped_total{reason}``), so it
must come from a short fixed list, never from free text a peer influences.
They are ``StrEnum`` members: they compare equal to their string values,
format as them, and metrics can pre-initialise every label from the enum.
"""

from __future__ import annotations

from enum import StrEnum


class Protocol(StrEnum):
    """The ``protocol`` of a routing endpoint (listener clients and bridges)."""

    SKAN = "skan"
    HSP = "hsp"
    EVENTER = "eventer"
    MARINER = "mariner"
    BRIDGE_HSP = "bridge-hsp"
    BRIDGE_EVENTER = "bridge-eventer"
    BRIDGE_MARINER = "bridge-mariner"


# The protocols that have a listener (a port clients connect to).
LISTENER_PROTOCOLS = (Protocol.SKAN, Protocol.HSP, Protocol.EVENTER, Protocol.MARINER)


class CloseReason(StrEnum):
    """Why a connection (or a bridge's endpoint) was closed."""

    # The peer closed its side (end of stream).
    EOF = "eof"
    # The connection broke (reset, broken pipe, TLS failure).
    RESET = "reset"
    # The broker is stopping gracefully.
    SHUTDOWN = "shutdown"
    # The peer broke its protocol (malformed input, message before the handshake).
    PROTOCOL_ERROR = "protocol-error"
    # Its outgoing queue was full under the disconnect policy.
    SLOW_CONSUMER = "slow-consumer"
    # No byte arrived within ping_timeout after an idle ping.
    PING_TIMEOUT = "ping-timeout"
    # An Eventer conversation the broker opened was not answered in time.
    CONVERSATION_TIMEOUT = "conversation-timeout"
    # Eventer MsgInitReq refused (token, subscriptions).
    INIT_REFUSED = "init-refused"
    # Credentials refused (Mariner token).
    UNAUTHORISED = "unauthorised"
    # A configuration reload withdrew the credential it authenticated with.
    REVOKED = "revoked"
    # The TLS handshake failed (e.g. a required client certificate missing).
    TLS_HANDSHAKE = "tls-handshake"
    # The protocol's opening did not complete within handshake_timeout.
    HANDSHAKE_TIMEOUT = "handshake-timeout"
    # A frame that had begun did not complete within frame_timeout.
    FRAME_TIMEOUT = "frame-timeout"
    # A Chatter conversation the peer opened or handed back and then left open
    # longer than wire.chatter.connection.MAX_HELD_AGE (expired, connection kept).
    ABANDONED_CONVERSATION = "abandoned-conversation"
    # Refused at accept: max_connections reached (broker-wide or per listener).
    TOO_MANY_CONNECTIONS = "too-many-connections"
    # A bridge's endpoint removed when the bridge stops.
    BRIDGE_STOPPED = "bridge-stopped"
    # Closed for no more specific reason.
    CLOSED = "closed"


class ErrorKind(StrEnum):
    """The kind of a counted protocol error (peer fault)."""

    # A Skan frame that cannot be split (length over max_frame, bad prefix).
    BAD_FRAME = "bad-frame"
    # A message that does not decode.
    MALFORMED = "malformed"
    # A well-formed message with a semantic fault (answered, connection kept).
    REJECTED = "rejected"
    # A subscribe past [broker] max_subscriptions (answered, connection kept).
    MAX_SUBSCRIPTIONS = "max-subscriptions"
    # A payload or frame over the size limit.
    TOO_LARGE = "too-large"
    # Credentials refused, or a message before the handshake.
    NOT_AUTHORISED = "not-authorised"
    # HSP DATA of a Type the listener does not carry.
    UNKNOWN_TYPE = "unknown-type"
    # HSP state-machine violation (unknown command, unexpected ACK).
    PROTOCOL_VIOLATION = "protocol-violation"
    # Eventer/Mariner message that breaks the protocol.
    BAD_MESSAGE = "bad-message"
    # Eventer MsgInitReq refused.
    INIT_REFUSED = "init-refused"
    # A bridged event that cannot become a Skan message.
    UNROUTABLE_EVENT = "unroutable-event"
    # The protocol's opening did not complete within handshake_timeout.
    HANDSHAKE_TIMEOUT = "handshake-timeout"
    # A frame that had begun did not complete within frame_timeout.
    FRAME_TIMEOUT = "frame-timeout"
    # The TLS handshake failed or timed out.
    TLS_HANDSHAKE = "tls-handshake"
    # A Chatter conversation the peer opened or handed back and then left open
    # longer than wire.chatter.connection.MAX_HELD_AGE (expired, connection kept).
    ABANDONED_CONVERSATION = "abandoned-conversation"


class DropReason(StrEnum):
    """Why a message was dropped (other than a full outgoing queue)."""

    # HSP DATA of an unknown Type.
    UNKNOWN_TYPE = "unknown-type"
    # A routed message a Mariner client cannot be sent.
    UNENCODABLE = "unencodable"
    # A message directed at a bridge that only receives (Mariner).
    ONE_WAY = "one-way"
    # The bridge's peer answered ERROR.
    REFUSED_BY_PEER = "refused-by-peer"
    # Over the payload limit.
    TOO_LARGE = "too-large"
    # Held for a persisted-notifications Eventer client, but the store failed
    # to commit it (disk full, I/O error, writer overloaded).
    NOT_PERSISTED = "not-persisted"


class RefusalReason(StrEnum):
    """Why a new connection was refused at accept (see :class:`CloseReason`)."""

    # [broker] max_connections reached.
    BROKER_LIMIT = "broker-limit"
    # The listener's own max_connections reached.
    LISTENER_LIMIT = "listener-limit"
