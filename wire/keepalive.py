"""The keep-alive pair as events, one pair for every codec that reports them.

A :class:`Ping` asks the peer to show it is alive and a :class:`Pong`
answers it; neither carries anything.  HSP, Mariner and NATS decode their
own bytes for them (``PING``/``PONG`` commands, ``{"type": "ping"}``,
``PING\\r\\n``) into these same two classes, and encode them back.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Ping:
    """A keep-alive request: the peer answers with :class:`Pong`."""


@attrs.frozen
class Pong:
    """The answer to a :class:`Ping`."""


__all__ = ["Ping", "Pong"]
