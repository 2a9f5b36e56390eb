"""The NATS backplane as one more routing endpoint (pure: no trio, no sockets).

Out: the backplane observes every routed message.  A message that entered
this broker (its sender is not the backplane) is published once on its
subject (:mod:`broker.cluster.subjects`), byte-identical, with the EventId
and timestamp this broker assigned in a NATS header.  Even a message
directed to one of this broker's own clients goes out: a promisc or
pattern subscriber on another broker may take it, and only NATS knows
where interest is.  NATS forwards a message only to servers with a
matching subscription, so a message nobody else wants costs this broker
one write of its bytes and nothing more (docs/cluster.md has the figures).

In: a message from NATS is routed to this broker's own endpoints only, with
the backplane as sender (so it never goes back out: "never to the sender"
is the loop guard), its origin's EventId and timestamp, and the rules of
section 1 applied again to the decoded header: the subject was only a
pre-filter.  Overlapping NATS subscriptions (a group's and our own
directed-traffic subject) deliver one message twice; a per-origin
high-water mark of (session, instance) drops the second copy.  It also
drops copies a NATS reconnect may repeat.

Interest: the backplane keeps one NATS subscription per group with local
subscribers (aggregated, not per instance), one for every group when a Hat
pattern's first segment is a wildcard, and one for traffic directed to its
own clients.  Protocol bytes go to ``send`` (the trio driver's queue
towards NATS, which returns False when it cannot take them: NATS is down
or slower than this broker, and the message is counted in ``drops``); by
default they collect in ``pending`` (the pure tests read them there).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from broker.cluster import subjects
from broker.core.router import STAR, Endpoint, Routed, Router
from wire import nats
from wire.errors import ProtocolError
from wire.skan import decode_header

ORIGIN_HEADER = b"Skan-Origin"
# The whole HPUB of one routed message in one formatting step (the per-message
# path): subject, header length, total length, then a header block holding
# the origin "server session instance timestamp-bits": the timestamp as the
# hex of its IEEE 754 bits, exact both ways and ~3x cheaper than repr().
_HEADER = b"NATS/1.0\r\nSkan-Origin: %d %d %d %x\r\n\r\n"
_DOUBLE = struct.Struct("<d")
_HPUB = b"HPUB %s %d %d\r\n%s%s\r\n"
_ORIGIN_AT = len(b"NATS/1.0\r\nSkan-Origin: ")
# Distinct (group, instance, to) subjects remembered; cleared when full (as
# the router's recipient cache): directed traffic to many lnames must not
# grow it without bound.
SUBJECT_CACHE_LIMIT = 65_536


def parse_origin(headers: bytes) -> tuple[int, int, int, float]:
    """(server, session, instance, timestamp) from a header block this module wrote."""
    if headers.startswith(_HEADER[:_ORIGIN_AT]):
        value = headers[_ORIGIN_AT:headers.find(b"\r", _ORIGIN_AT)]
    else:
        found = nats.parse_headers(headers).get(ORIGIN_HEADER)
        if found is None:
            raise ValueError("message without origin header")
        value = found
    parts = value.split()
    if len(parts) != 4:
        raise ValueError("bad origin header")
    bits = int(parts[3], 16)
    if not 0 <= bits < 1 << 64:
        raise ValueError("bad origin timestamp")
    timestamp = _DOUBLE.unpack(bits.to_bytes(8, "little"))[0]
    return int(parts[0]), int(parts[1]), int(parts[2]), timestamp


class RemoteSender(Endpoint):
    """The sender of a message that arrived over the backplane (never a recipient)."""

    protocol = "cluster"

    def deliver(self, frame: bytes, routed: Routed) -> None:  # pragma: no cover - never called
        pass


class Backplane(Endpoint):
    """This broker's side of the backplane: publishes, subscribes, dedupes."""

    protocol = "cluster"

    def __init__(self, router: Router, server_id: int) -> None:
        super().__init__()
        self.router = router
        self.server_id = server_id
        self.lname = b"backplane/%d" % server_id
        self.pending: list[bytes] = []
        self.send: Callable[[bytes], bool] = self._keep
        # subject -> (sid, reference count)
        self._subs: dict[bytes, list[Any]] = {}
        self._next_sid = 0
        # origin server id -> last (session, instance) routed from it
        self._hwm: dict[int, tuple[int, int]] = {}
        self.sent = 0
        self.drops = 0
        self.received = 0
        self.duplicates = 0
        self.malformed = 0
        self.on_malformed: Callable[[str], None] | None = None
        self._remote = RemoteSender()
        self._subjects: dict[tuple[bytes, bytes, bytes], bytes] = {}
        router.observers.append(self.observe)
        router.interest.append(self.interest_changed)
        self._add(subjects.own_interest(server_id))

    # ---- out -------------------------------------------------------------

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: publish the batch's messages that did not come from NATS."""
        remote = self._remote
        cache = self._subjects
        send = self.send
        for routed in batch:
            if routed.sender is remote:
                continue
            header = routed.header
            key = (header[b"group"], header[b"instance"], header[b"to"])
            subject = cache.get(key)
            if subject is None:
                if len(cache) >= SUBJECT_CACHE_LIMIT:
                    cache.clear()
                subject = cache[key] = subjects.message_subject(*key)
            block = _HEADER % (routed.server, routed.session, routed.instance,
                               int.from_bytes(_DOUBLE.pack(routed.timestamp), "little"))
            frame = routed.frame
            hlen = len(block)
            if send(_HPUB % (subject, hlen, hlen + len(frame), block, frame)):
                self.sent += 1
            else:
                self.drops += 1

    def deliver(self, frame: bytes, routed: Routed) -> None:
        """The backplane is never a local recipient (it holds no subscriptions)."""

    # ---- interest --------------------------------------------------------

    def interest_changed(self, key: tuple[bytes, ...] | bytes, added: bool) -> None:
        """A group (bytes) or Hat pattern (tuple) gained its first / lost its last subscriber."""
        if isinstance(key, tuple):
            first = key[0] if key else STAR
            subject = (subjects.ALL_INTEREST if first in (STAR, b"?")
                       else subjects.group_interest(first))
        else:
            subject = subjects.group_interest(key)
        if added:
            self._add(subject)
        else:
            self._drop(subject)

    def _add(self, subject: bytes) -> None:
        entry = self._subs.get(subject)
        if entry is not None:
            entry[1] += 1
            return
        self._next_sid += 1
        sid = b"%d" % self._next_sid
        self._subs[subject] = [sid, 1]
        self.send(nats.sub(subject, sid))  # if lost, resubscribe() restores it

    def _drop(self, subject: bytes) -> None:
        entry = self._subs.get(subject)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._subs[subject]
            self.send(nats.unsub(entry[0]))

    def resubscribe(self) -> list[bytes]:
        """Commands that restore every subscription on a fresh NATS connection."""
        return [nats.sub(subject, sid) for subject, (sid, _) in self._subs.items()]

    @property
    def subjects(self) -> set[bytes]:
        return set(self._subs)

    # ---- in --------------------------------------------------------------

    def receive(self, msg: nats.Msg) -> None:
        """Route one message from NATS to this broker's own endpoints."""
        try:
            if msg.headers is None:
                raise ValueError("message without origin header")
            server, session, instance, timestamp = parse_origin(msg.headers)
            header = decode_header(msg.payload, 4)
            for tag in (b"group", b"instance", b"to", b"from"):
                if not isinstance(header.get(tag), bytes):
                    raise ValueError(f"routed frame without {tag.decode()}")
        except (ValueError, ProtocolError) as exc:
            self.malformed += 1
            if self.on_malformed is not None:
                self.on_malformed(str(exc))
            return
        if server == self.server_id:
            return  # our own message (echo is off; a misconfigured peer id)
        mark = (session, instance)
        last = self._hwm.get(server)
        if last is not None and mark <= last:
            self.duplicates += 1
            return
        self._hwm[server] = mark
        self.received += 1
        self._remote.lname = header[b"from"]
        self.router.route(
            self._remote, msg.payload, header,
            origin=(server, session, instance, timestamp),
        )

    def _keep(self, data: bytes) -> bool:
        self.pending.append(data)
        return True

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data
