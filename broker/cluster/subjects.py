"""NATS subjects for routed Skan messages, and the interest a broker subscribes to.

A routed message travels on ``sk.<server>.<group>.<instance>.<dest>``:

- ``<server>`` is the server id of the broker that publishes it (the
  broker the message entered).  A broker publishes only on subjects that
  name it: NATS permissions can then give each broker's user
  ``sk.<own id>.>`` and nothing else of ``sk.``, and a receiving broker
  accepts a run only if its origin and every frame's ``from`` name that
  same broker (BROKER-SPEC section 8, "What a broker believes from NATS").

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

Interest subscriptions take every publisher (``sk.*.<group>.>``).
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
# Server ids, sessions and instances are EventId parts: Hat's int64, so
# never more than 19 decimal digits on the wire (and below 2**63).
MAX_SERVER_DIGITS = 19
INT64_LIMIT = 2**63


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


def owns(lname: bytes, server: bytes) -> bool:
    """Whether ``lname`` is an lname of broker ``server`` (its id as decimal
    bytes): host part ``HOST/<server>``.  The receiving broker's check that a
    frame speaks for the broker that published it, once per run."""
    cut = len(lname) - len(server) - 1
    return (lname.endswith(server) and lname[cut:cut + 1] == LNAME_SERVER_SEP
            and lname.rfind(b"@", 0, cut) >= 0)


def message_subject(server: int, group: bytes, instance: bytes, to: bytes) -> bytes:
    """The subject broker ``server`` publishes a message of (group, instance, to) on."""
    if to == b"*":
        dest = BROADCAST
    else:
        target = owner(to)
        dest = b"b" + target if target is not None else UNOWNED
    return b"%s%d.%s.%s.%s" % (PREFIX, server, escape(group), escape(instance), dest)


def publisher(subject: bytes) -> bytes | None:
    """The server id token of a message subject (``sk.<server>.``), None if it has none."""
    end = subject.find(b".", len(PREFIX))
    if end < 0 or not subject.startswith(PREFIX):
        return None
    server = subject[len(PREFIX):end]
    return server if server.isdigit() and len(server) <= MAX_SERVER_DIGITS else None


def group_interest(group: bytes) -> bytes:
    """Everything on ``group`` from any broker: broadcasts and directed (promisc
    and patterns need them)."""
    return PREFIX + b"*." + escape(group) + b".>"


def own_interest(server_id: int) -> bytes:
    """Everything directed to this broker's clients, on any group (replies need it)."""
    return PREFIX + b"*.*.*.b%d" % server_id


def own_subjects(server_id: int) -> bytes:
    """What broker ``server_id`` publishes its messages on (for NATS permissions)."""
    return PREFIX + b"%d.>" % server_id


# Every message: a Hat pattern whose first segment is a wildcard may take any group.
ALL_INTEREST = PREFIX + b">"

# Control subjects (broker/cluster/cluster_service.py), one per publishing broker
# (``<prefix><server id>``); each broker subscribes to ``<prefix>*``.
HEARTBEAT = b"skc.hb."
INTEREST = b"skc.int."
QUERY = b"skc.query."
# Who is alive: a broker asks with a reply subject, every live broker answers.
PING = b"skc.ping."
# Start-up: is this server id taken?  (Asked and answered by that id only.)
ID_PROBE = b"skc.id."


def control(prefix: bytes, server_id: int) -> bytes:
    return prefix + b"%d" % server_id


def control_sender(subject: bytes, prefix: bytes) -> int | None:
    """The server id a control subject names (None: not one of ``prefix``)."""
    token = subject[len(prefix):]
    if not subject.startswith(prefix) or not token.isdigit() or len(token) > MAX_SERVER_DIGITS:
        return None
    server = int(token)
    return server if server < INT64_LIMIT else None
