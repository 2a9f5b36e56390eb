"""Routing-log records: one JSON Lines record per routed message (pure, no I/O).

A record carries the fields of BROKER-SPEC section 6::

    {"time_us":1718000000123456,"lname":"6650_1@host","proto":"skan","group":"g",
     "instance":"*","to":"*","seq":"17","size":93,"recipients":{"skan":2},
     "delivered":2,"undeliverable":false,"event_session":1718..,"event_instance":3}

``time_us`` is the routing time in Unix microseconds (an integer: formatting
a float costs three times more), ``seq`` is empty if the message had none, ``size``
the routed Skan frame in bytes (length prefix included, as the router counts
it), ``recipients`` the copies handed to each protocol (the sender excluded),
``event_session``/``event_instance`` the Hat EventId parts, unique per broker.

Speed: the formatter runs once per routed message, so it uses a string
template and caches every fragment that repeats: the sender part per
endpoint, the group/instance/to part per routing key and the recipients
map per recipient tuple (the router hands out the same cached tuple for
every message of one routing key).  Only ``seq`` and the numbers change per
record.  ``json.dumps`` of the whole record would cost several times more.

Escaping: DATA values are bytes.  Printable ASCII without ``"``/``\\`` goes
in as is; anything else is decoded as UTF-8 and escaped by ``json``; bytes
that are not UTF-8 appear as ``\\xNN`` (backslash, x, two hex digits) so a
line is always valid JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from broker.router import Endpoint, Routed

# Record fields, in the order they are written (the analytics schema must match).
FIELDS = (
    "time_us", "lname", "proto", "group", "instance", "to", "seq", "size", "recipients",
    "delivered", "undeliverable", "event_session", "event_instance",
)

_PLAIN = re.compile(rb"[\x20\x21\x23-\x5b\x5d-\x7e]*\Z")

# Cache bounds: each cache is simply cleared when full (rebuilding an entry
# is one small string operation).  They bound memory when a broker sees
# endless distinct senders, routing keys or subscription changes.
SENDER_CACHE = 16_384
KEY_CACHE = 65_536
RECIPIENT_CACHE = 16_384


def json_str(value: bytes) -> str:
    """A JSON string literal for DATA bytes (see the module doc on escaping)."""
    if _PLAIN.match(value):
        return '"' + value.decode("ascii") + '"'
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = value.decode("utf-8", "backslashreplace")
    return json.dumps(text, ensure_ascii=False)


def recipients_json(recipients: Iterable[Endpoint], sender: Endpoint | None = None) -> str:
    """``{"proto": copies, ...}`` for a recipient set, leaving out the sender."""
    counts: dict[str, int] = {}
    for ep in recipients:
        if ep is not sender:
            counts[ep.protocol] = counts.get(ep.protocol, 0) + 1
    return "{" + ",".join(f'"{p}":{n}' for p, n in sorted(counts.items())) + "}"


class RecordFormatter:
    """Turns :class:`Routed` messages into JSON Lines text, caching repeated parts."""

    def __init__(self) -> None:
        self._senders: dict[Endpoint, str] = {}
        self._keys: dict[tuple[bytes, bytes, bytes], str] = {}
        # id(tuple) -> (tuple, fragment without sender); the entry keeps the
        # tuple alive, so its id cannot be reused while it is cached.
        self._recips: dict[int, tuple[tuple[Endpoint, ...], str]] = {}
        self._recips_minus: dict[tuple[int, Endpoint], str] = {}

    def _sender(self, ep: Endpoint) -> str:
        frag = self._senders.get(ep)
        if frag is None:
            if len(self._senders) >= SENDER_CACHE:
                self._senders.clear()
            frag = f'"lname":{json_str(ep.lname)},"proto":{json_str(ep.protocol.encode())}'
            self._senders[ep] = frag
        return frag

    def _key(self, key: tuple[bytes, bytes, bytes]) -> str:
        frag = self._keys.get(key)
        if frag is None:
            if len(self._keys) >= KEY_CACHE:
                self._keys.clear()
            group, instance, to = key
            frag = f'"group":{json_str(group)},"instance":{json_str(instance)},"to":{json_str(to)}'
            self._keys[key] = frag
        return frag

    def _pin(self, recips: tuple[Endpoint, ...]) -> str:
        """The cached fragment of a recipient tuple (cached by id, tuple kept alive)."""
        entry = self._recips.get(id(recips))
        if entry is None or entry[0] is not recips:
            if len(self._recips) >= RECIPIENT_CACHE:
                # Both caches go together: the second is keyed by the ids the first pins.
                self._recips.clear()
                self._recips_minus.clear()
            entry = (recips, recipients_json(recips))
            self._recips[id(recips)] = entry
        return entry[1]

    def _recipients(self, routed: Routed) -> str:
        recips = routed.recipients
        frag = self._pin(recips)
        if routed.delivered == len(recips):
            return frag
        # The sender is among its own recipients (it subscribed to the group).
        mkey = (id(recips), routed.sender)
        frag = self._recips_minus.get(mkey)
        if frag is None:
            if len(self._recips_minus) >= RECIPIENT_CACHE:
                self._recips_minus.clear()
            frag = recipients_json(recips, routed.sender)
            self._recips_minus[mkey] = frag
        return frag

    @staticmethod
    def _seq(seq: object) -> str:
        """``seq`` string contents, escaped (without quotes); empty when absent."""
        if type(seq) is not bytes:
            return ""
        return json_str(seq)[1:-1]

    def format(self, batch: Iterable[Routed]) -> str:
        """JSON Lines text (one line per message, each ending in a newline)."""
        senders = self._senders
        keys = self._keys
        recips_cache = self._recips
        lines = []
        append = lines.append
        for r in batch:
            h = r.header
            sender = r.sender
            sfrag = senders.get(sender) or self._sender(sender)
            key = (h[b"group"], h[b"instance"], h[b"to"])
            kfrag = keys.get(key) or self._key(key)
            recips = r.recipients
            d = r.delivered
            entry = recips_cache.get(id(recips))
            if entry is not None and d == len(recips):
                rfrag = entry[1]
            else:
                rfrag = self._recipients(r)
            seq = h.get(b"seq")
            if type(seq) is bytes and seq.isdigit():
                sq = seq.decode()
            else:
                sq = self._seq(seq)
            append(
                f'{{"time_us":{int(r.timestamp * 1e6)},{sfrag},{kfrag},"seq":"{sq}",'
                f'"size":{len(r.frame)},"recipients":{rfrag},"delivered":{d},'
                f'"undeliverable":{"false" if d else "true"},'
                f'"event_session":{r.session},"event_instance":{r.instance}}}\n'
            )
        return "".join(lines)
