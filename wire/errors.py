"""The one family of wire errors, in the manner of h11.

Every codec and state machine in :mod:`wire` raises only these (or a
subclass): a caller that handles peer faults catches
:class:`RemoteProtocolError` (or the base :class:`ProtocolError`) and
nothing else, so a programming bug (``ValueError``, ``TypeError``,
``KeyError`` ...) is never mistaken for a misbehaving peer.  The base is
deliberately *not* a ``ValueError``.

::

    ProtocolError                  base: .reason, .offset, .events
    ├── LocalProtocolError         *we* tried to send or encode what the protocol forbids
    └── RemoteProtocolError        the peer broke the protocol
        ├── FramingError           the byte stream cannot be split any more: close
        └── MalformedError         one message is not well-formed (the framing is intact)
            └── LimitError         a message exceeds a decoder limit (items, depth, digits)

Whether a :class:`MalformedError` closes the connection is the protocol's
choice (Skan closes; Skan-over-HSP answers ERROR 1 and stays open).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ProtocolError(Exception):
    """A protocol rule was broken.

    ``reason`` is one readable sentence (what is wrong, fit for an error frame
    or a log line); ``offset``, when known, is where in the message or the
    stream the fault is (a hint; ``reason`` usually says it too); ``events``
    holds the well-formed events decoded from the same input before the
    fault, so a caller can still act on them before closing.
    """

    def __init__(
        self, reason: str, *, offset: int | None = None, events: Iterable[Any] = ()
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset
        self.events: list[Any] = list(events)

    def __str__(self) -> str:
        return self.reason


class LocalProtocolError(ProtocolError):
    """This side tried to send (or encode) something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol."""


class FramingError(RemoteProtocolError):
    """The byte stream cannot be trusted any more (bad or oversized length); close."""


class MalformedError(RemoteProtocolError):
    """One message is not a well-formed message of the protocol."""


class LimitError(MalformedError):
    """A message is refused because it exceeds a decoder limit (see :mod:`wire.limits`)."""


__all__ = [
    "FramingError",
    "LimitError",
    "LocalProtocolError",
    "MalformedError",
    "ProtocolError",
    "RemoteProtocolError",
]
