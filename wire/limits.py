"""Decoder limits: what one received message may cost, whatever its protocol.

Frames are bounded in bytes by ``max_frame`` (framing), but the work a
decoder does grows with the number of *items* (a Skan LIST of 8,000,000
NULLs is 8 MB; walking it in Python froze the broker for 3 s) and a
recursive walk grows with *depth*.  These bounds make the work per message
small and refuse the rest as a :class:`~wire.errors.LimitError` (a malformed
message), before any per-item Python work beyond the limit.  One set of
numbers for every decoder, so what one protocol accepts another can carry:
a JSON payload within the limits becomes a Skan ``msg`` within them.
docs/limits.md ("Decoder limits") explains each choice.
"""

from __future__ import annotations

from wire.errors import LimitError

# Items (Skan items at any depth including the routing tags; SBS array
# elements; JSON values and object members) in one message.  Walking 100,000
# items costs about 40 ms of Python, so one hostile frame cannot hold the
# event loop for long; real messages carry a few hundred.
MAX_ITEMS = 100_000

# Items in one message that carries a whole routing batch to us as a
# *client* (a Mariner ``events`` message, an Eventer MsgEventsNotify or
# MsgQueryRes from a server we dial).  A batch is what one received chunk
# (256 KiB) routes, plus at most one large frame, so it may legitimately
# hold several times MAX_ITEMS; this still refuses a frame of millions of
# empty items.
MAX_BATCH_ITEMS = 10 * MAX_ITEMS

# Nesting levels of containers (Skan HASH/LIST, JSON arrays/objects).  The
# walks that follow a decode (validation, JSON <-> Skan mapping) recurse
# once per level, so the depth a peer chooses must stay far below Python's
# recursion limit (1,000): RecursionError is then impossible.
MAX_DEPTH = 100

# Levels a protocol's own envelope adds around a payload (a Mariner event's
# payload sits 4 levels down in an ``events`` message): a payload at
# MAX_DEPTH still fits its envelope.
ENVELOPE_DEPTH = 8

# Routing tags a Skan message the broker builds puts around an event payload
# (type, from, to, group, instance, seq, msg, payload-type, source-timestamp,
# hsp-type, with room to spare).
HEADER_ITEMS = 16

# Items of one event payload (JSON), so that the Skan message the broker
# builds from it (payload + routing tags) passes MAX_ITEMS at every Skan peer.
MAX_PAYLOAD_ITEMS = MAX_ITEMS - HEADER_ITEMS

# Decimal digits of one JSON integer.  int64 needs 19, and Python refuses
# more than 4,300 with a ValueError; 100 digits carries any integer a Hat
# peer can mean while converting it costs nothing.
MAX_INT_DIGITS = 100


class ItemBudget:
    """The items one message may still use; shared by the parts of one message.

    ``spend(n)`` raises :class:`~wire.errors.LimitError` once the message has
    used more than ``limit`` items in total (e.g. an Eventer MsgRegisterReq:
    its SBS array elements plus the JSON values of every payload).
    """

    __slots__ = ("left", "limit")

    def __init__(self, limit: int = MAX_ITEMS) -> None:
        self.limit = limit
        self.left = limit

    def spend(self, n: int, what: str = "message") -> None:
        self.left -= n
        if self.left < 0:
            raise LimitError(f"{what} has more than {self.limit} items")


__all__ = [
    "ENVELOPE_DEPTH",
    "HEADER_ITEMS",
    "MAX_BATCH_ITEMS",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_ITEMS",
    "MAX_PAYLOAD_ITEMS",
    "ItemBudget",
]
