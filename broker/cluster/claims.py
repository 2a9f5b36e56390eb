"""Who a message or query from another broker speaks for: the user claim (pure).

A broker enforces section 7 for its own clients; a message or query that
crosses NATS carries the claim of the user it entered as (one token), and
the broker that delivers or answers applies *its own* configuration of that
user (BROKER-SPEC section 8: "permissions are enforced for the user who
asked, on the broker that answers").  Tokens:

- ``*``: full rights (a bridge without ``user``, a listener token, an
  anonymous client of a broker that grants anonymous full rights);
- ``~``: anonymous: the answering broker gives what *it* gives anonymous
  clients (``anonymous_user``, full rights, or nothing when it allows none);
- any other token: a user name, escaped as an interest token (bytes outside
  ``[A-Za-z0-9_-]`` as ``%XX``), so it is never ``*`` or ``~``.

A claim is only as true as the broker that publishes it: NATS permissions
make sure only broker N publishes as broker N (docs/cluster.md, threat
model).  What the claim buys is that every broker applies its own
``[[users]]`` to what it delivers or answers, and that a forged message or
query naming a user gets no more than that user may have.  Queries are
stricter than messages: a full-rights claim is honoured for a query only by
a broker without ``[[users]]`` (where every client that gets in has full
rights), else answered as anonymous.
"""

from __future__ import annotations

from broker.cluster.interest import escape, unescape
from broker.core.auth import Authenticator, Permissions, Principal
from wire.errors import MalformedError

FULL = b"*"
ANONYMOUS = b"~"
# A user name's token at most (names are short; a claim is one header field).
MAX_CLAIM = 256
# What a claim that grants nothing gets (an unknown user, anonymous refused).
NOTHING = Permissions(None, (), ())


def claim(principal: Principal | None) -> bytes:
    """The token for what ``principal`` (None: not logged in: full rights) may do."""
    if principal is None or principal.perms is None:
        return FULL
    if principal.name is None:
        return ANONYMOUS
    return escape(principal.name.encode())


def check(token: bytes) -> bytes:
    """``token`` if it is a well-formed claim, else MalformedError."""
    if token in (FULL, ANONYMOUS):
        return token
    if not token or len(token) > MAX_CLAIM:
        raise MalformedError("bad user claim")
    unescape(token)  # MalformedError when it is not an escaped name
    return token


def permissions(token: bytes, auth: Authenticator, query: bool = False) -> Permissions | None:
    """What a (checked) claim may do on this broker: None is full rights,
    :data:`NOTHING` when this broker grants it nothing."""
    if token == FULL and not (query and auth.users):
        return None
    if token in (FULL, ANONYMOUS):
        if not auth.allow_anonymous:
            return NOTHING
        if auth.anonymous_user is not None:
            return auth.users[auth.anonymous_user].permissions
        return None
    user = auth.users.get(unescape(token).decode(errors="replace"))
    return NOTHING if user is None else user.permissions


def name(token: bytes) -> str:
    """The claim for log lines and error text."""
    if token == FULL:
        return "(full rights)"
    if token == ANONYMOUS:
        return "(anonymous)"
    return repr(unescape(token).decode(errors="replace"))
