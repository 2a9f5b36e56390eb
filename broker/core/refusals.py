"""Refusals: a well-formed request the broker will not carry out.  One family, raised.

Every refusal in the core API is an exception of this family, raised where
the rule lives and counted there once: the router's and the enforcer's
(:class:`NotPermitted`, :class:`TooManySubscriptions`), ``broker/core/inject.py``'s
(:class:`FrameTooLarge`) and the Skan message semantics of
``broker/core/skan_handler.py`` (:class:`Refused` itself).  An adapter
catches :class:`Refused` and answers with its own protocol's error (a Skan
error frame with the ``seq``, an HSP ERROR, an Eventer init refusal, a
Mariner error), counting it under :attr:`Refused.kind`.

Why raised and not returned (see docs/architecture.md, "Errors"): a refusal
cannot be dropped by a caller that forgets to look (a returned one can, and
the message would then count as carried); ``Router.route`` keeps returning
what it routed; and a ``try`` costs nothing on the hot path until something
is refused (Python 3.11's zero-cost exceptions).  The other family,
``wire/errors.py`` ``ProtocolError``, is for bytes that do not parse; this one
for what parses and is refused.

Pure: no trio, no I/O.
"""

from __future__ import annotations

from typing import Any, ClassVar

from broker.core.reasons import ErrorKind


class Refused(Exception):
    """A well-formed request refused; ``reason`` says why, for the peer.

    ``seq`` is the Skan ``seq`` of the message it answers (None: none known);
    ``close`` asks the adapter to end the connection after answering.
    """

    # The protocol-error label the adapter counts it under (a metric label).
    kind: ClassVar[ErrorKind] = ErrorKind.REJECTED
    # A refusal of BROKER-SPEC section 7 (credentials or permissions): HSP
    # answers it with ERROR 4.
    denied: ClassVar[bool] = False

    def __init__(self, reason: str, seq: bytes | None = None, *, close: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seq = seq
        self.close = close

    def answering(self, seq: bytes | None) -> Refused:
        """The same refusal as the answer to the message numbered ``seq``."""
        return type(self)(self.reason, seq, close=self.close)

    def error_message(self) -> dict[str, Any]:
        """The Skan error message that answers it (Skan and Skan over HSP)."""
        msg: dict[str, Any] = {"type": "error", "error": self.reason}
        if self.seq is not None:
            msg["seq"] = self.seq
        return msg


class NotPermitted(Refused):
    """Credentials refused, or a send or subscription outside the connection's
    permissions (counted by the enforcer: ``auth_failures`` or
    ``permission_denied``)."""

    kind = ErrorKind.NOT_AUTHORISED
    denied = True


class TooManySubscriptions(Refused):
    """A subscription past ``[broker] max_subscriptions`` (counted in
    ``subscriptions_refused``; nothing subscribed)."""

    kind = ErrorKind.MAX_SUBSCRIPTIONS


class FrameTooLarge(Refused):
    """A message the broker built is larger than ``max_frame`` (counted as a
    ``too-large`` protocol error; nothing routed)."""

    kind = ErrorKind.TOO_LARGE
