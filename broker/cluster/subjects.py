"""NATS subjects for routed Skan messages, and the interest a broker subscribes to.

A routed message travels on ``sk.<group>.<instance>.<dest>``:

- ``<group>`` and ``<instance>`` are escaped tokens: bytes outside
  ``[A-Za-z0-9_-]`` become ``%XX``, so a token never holds NATS's
  separators or wildcards (``.``, ``*``, ``>``, white space).  A token
  longer than :data:`MAX_TOKEN` is replaced by ``#`` plus a hash of it (a
  subject is only a pre-filter: the receiving broker re-applies every rule
  of section 1 to the decoded header, so a hash collision costs a wasted
  delivery, never a wrong one).
- ``<dest>`` is ``_`` for a broadcast (``to = "*"``), ``b<server_id>`` for a
  message directed to an lname owned by that broker, ``x`` for one directed
  to an lname no broker of the cluster owns (kept for promisc subscribers).

Interest is aggregated per group (one NATS subscription per group with
local subscribers, not one per instance: NATS route interest exchange is
what falls over with hundreds of thousands of subscriptions), plus one
subscription for everything directed to this broker's own clients.
"""

from __future__ import annotations

import hashlib

PREFIX = b"sk."
BROADCAST = b"_"
UNOWNED = b"x"
# Escaped tokens above this become a hash: NATS subjects should stay short
# (every server keeps them in its sublist) and a 200-byte token is already
# far beyond any group name people choose.
MAX_TOKEN = 200
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPED = [bytes([b]) if b in _SAFE else b"%%%02X" % b for b in range(256)]
# Host part of a cluster lname: ``HOST/SERVER_ID`` (BROKER-SPEC section 7).
LNAME_SERVER_SEP = b"/"


def escape(token: bytes) -> bytes:
    if token and all(b in _SAFE for b in token):
        out = token
    else:
        out = b"".join(_ESCAPED[b] for b in token) or b"%"
    if len(out) > MAX_TOKEN:
        out = b"#" + hashlib.blake2b(token, digest_size=16).hexdigest().encode()
    return out


def owner(lname: bytes) -> bytes | None:
    """The server id owning a cluster lname (``T_C@HOST/ID``), else None."""
    at = lname.rfind(b"@")
    if at < 0:
        return None
    slash = lname.rfind(LNAME_SERVER_SEP, at)
    if slash < 0:
        return None
    server = lname[slash + 1:]
    return server if server.isdigit() else None


def message_subject(group: bytes, instance: bytes, to: bytes) -> bytes:
    if to == b"*":
        dest = BROADCAST
    else:
        server = owner(to)
        dest = b"b" + server if server is not None else UNOWNED
    return b"%s%s.%s.%s" % (PREFIX, escape(group), escape(instance), dest)


def group_interest(group: bytes) -> bytes:
    """Everything on ``group``: broadcasts and directed (promisc and patterns need them)."""
    return PREFIX + escape(group) + b".>"


def own_interest(server_id: int) -> bytes:
    """Everything directed to this broker's clients, on any group (replies need it)."""
    return PREFIX + b"*.*.b%d" % server_id


# Every message: a Hat pattern whose first segment is a wildcard may take any group.
ALL_INTEREST = PREFIX + b">"
