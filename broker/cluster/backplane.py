"""The NATS backplane as one more routing endpoint (pure: no trio, no sockets).

Out: the backplane observes every routing batch.  The messages that entered
this broker (their sender is not the backplane) are published on their
subjects (:mod:`broker.cluster.subjects`), byte-identical, in *runs*
(:mod:`broker.cluster.runs`): the consecutive messages of a batch that
share a subject travel as one NATS message.  So NATS, and the parsing on both brokers, pay their
per-message cost once per run, not once per Skan message; a lone message is
a run of one.  The whole batch goes to NATS in one write.  Even a message
directed to one of this broker's own clients goes out: a promisc or
pattern subscriber on another broker may take it, and only NATS knows
where interest is.  NATS forwards a message only to servers with a
matching subscription, so a message nobody else wants costs this broker
its share of one write and nothing more (docs/cluster.md has the figures).

In: each frame of a run from NATS is routed to this broker's own endpoints
only, with the backplane as sender (so it never goes back out: "never to the
sender" is the loop guard), its origin's EventId and timestamp, and the
rules of section 1 applied again to the decoded header: the subject was
only a pre-filter.  Overlapping NATS subscriptions (a group's and our own
directed-traffic subject) deliver one run twice; a per-origin high-water
mark of (session, instance) drops the second copy.  It also drops copies a
NATS reconnect may repeat.  What cannot be decoded is counted in
``malformed`` and reported to ``on_malformed`` (the service logs it, rate
limited).

Interest: the backplane keeps one NATS subscription per group with local
subscribers (aggregated, not per instance), one for every group when a Hat
pattern's first segment is a wildcard, and one for traffic directed to its
own clients.  Protocol bytes go to ``send`` (the trio driver's queue
towards NATS, which returns False when it cannot take them: NATS is down
or slower than this broker, and the messages are counted in ``drops``); by
default they collect in ``pending`` (the pure tests read them there).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from operator import attrgetter, itemgetter
from typing import Any

from broker.cluster import subjects
from broker.cluster.runs import HEADER_ROOM, RUN_BYTES, STAMP, encode_run, unpack_run
from broker.core.router import STAR, Endpoint, Routed, Router
from wire import nats
from wire.errors import ProtocolError
from wire.skan import decode_header

# Distinct (group, instance, to) subjects remembered; cleared when full (as
# the router's recipient cache): directed traffic to many lnames must not
# grow it without bound.
SUBJECT_CACHE_LIMIT = 65_536
# Field getters, for the C-level pass over a batch (Backplane._one_subject).
_SENDER = attrgetter("sender")
_HEADER_OF = attrgetter("header")
_FRAME = attrgetter("frame")
_TIMESTAMP = attrgetter("timestamp")
_KEY = itemgetter(b"group", b"instance", b"to")


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
        # Messages too large for NATS's max_payload (counted in drops too).
        self.oversized = 0
        # NATS's max_payload (its INFO; the service sets it per connection).
        self.max_payload = nats.DEFAULT_MAX_PAYLOAD
        self.on_malformed: Callable[[str], None] | None = None
        self._remote = RemoteSender()
        self._subjects: dict[tuple[bytes, bytes, bytes], bytes] = {}
        self._in_runs = 0  # messages the last observe() put in runs
        router.observers.append(self.observe)
        router.interest.append(self.interest_changed)
        self._add(subjects.own_interest(server_id))

    # ---- out -------------------------------------------------------------

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: publish, in runs and in one write, the batch's messages
        that did not come from NATS."""
        remote = self._remote
        senders = list(map(_SENDER, batch))
        if remote in senders:
            if senders.count(remote) == len(senders):
                return
            batch = [r for r in batch if r.sender is not remote]
        parts: list[bytes] = []
        if not self._one_subject(batch, parts):
            self._runs(batch, parts)
        if parts:
            sent = self._in_runs
            if self.send(b"".join(parts)):
                self.sent += sent
            else:
                self.drops += sent

    def _one_subject(self, batch: list[Routed], parts: list[bytes]) -> bool:
        """The common batch, in C-level calls: one publisher's consecutive messages
        on one (group, instance, to).  False (nothing done) for any other batch."""
        keys = list(map(_KEY, map(_HEADER_OF, batch)))
        head, last, n = batch[0], batch[-1], len(batch)
        if (keys.count(keys[0]) != n or last.session != head.session
                or last.instance - head.instance != n - 1):
            return False
        frames = list(map(_FRAME, batch))
        lens = list(map(len, frames))
        if max(lens) > self.max_payload - HEADER_ROOM - STAMP:
            return False  # the general path drops it
        stamps = list(map(_TIMESTAMP, batch))
        subject = self._subject(keys[0])
        ends = list(accumulate(map(STAMP.__add__, lens)))  # payload bytes up to each message
        server, session, first = head.server, head.session, head.instance
        i = done = 0
        while i < n:
            j = max(bisect_right(ends, done + RUN_BYTES, i), i + 1)
            parts += encode_run(subject, server, session, first + i, stamps[i:j], frames[i:j],
                                ends[j - 1] - done)
            done = ends[j - 1]
            i = j
        self._in_runs = n
        return True

    def _runs(self, batch: list[Routed], parts: list[bytes]) -> None:
        """Any batch, message by message: a run ends where the subject, the
        origin's session or the instance sequence changes, or at RUN_BYTES."""
        largest = self.max_payload - HEADER_ROOM  # a run of one must fit
        frames: list[bytes] = []
        stamps: list[float] = []
        subject = b""
        server = session = first = nxt = size = 0
        sent = 0
        for routed in batch:
            header = routed.header
            subj = self._subject((header[b"group"], header[b"instance"], header[b"to"]))
            frame = routed.frame
            n = len(frame) + STAMP
            if n > largest:
                self.drops += 1  # NATS would refuse it and close the connection
                self.oversized += 1
                continue
            if (subj != subject or routed.instance != nxt or routed.session != session
                    or routed.server != server or size + n > RUN_BYTES):
                if frames:
                    parts += encode_run(subject, server, session, first, stamps, frames, size)
                    sent += len(frames)
                    frames = []
                    stamps = []
                subject = subj
                server = routed.server
                session = routed.session
                first = nxt = routed.instance
                size = 0
            frames.append(frame)
            stamps.append(routed.timestamp)
            nxt += 1
            size += n
        if frames:
            parts += encode_run(subject, server, session, first, stamps, frames, size)
            sent += len(frames)
        self._in_runs = sent

    def _subject(self, key: tuple[bytes, bytes, bytes]) -> bytes:
        cache = self._subjects
        subject = cache.get(key)
        if subject is None:
            if len(cache) >= SUBJECT_CACHE_LIMIT:
                cache.clear()
            subject = cache[key] = subjects.message_subject(*key)
        return subject

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
        """Route one run from NATS to this broker's own endpoints."""
        try:
            server, session, first, stamps, frames = unpack_run(msg)
        except (ValueError, ProtocolError) as exc:
            self.count_malformed(f"{msg.subject.decode(errors='replace')}: {exc}")
            return
        if server == self.server_id:
            return  # our own message (echo is off; a misconfigured peer id)
        last = self._hwm.get(server)
        if last is not None and (session, first) <= last:
            self.duplicates += len(frames)
            return
        self._hwm[server] = (session, first + len(frames) - 1)
        remote = self._remote
        route = self.router.route
        routed = 0
        for i, frame in enumerate(frames):
            try:
                header = decode_header(frame, 4)
            except ProtocolError as exc:
                self.count_malformed(f"{msg.subject.decode(errors='replace')}: {exc}")
                continue
            group = header.get(b"group")
            instance = header.get(b"instance")
            to = header.get(b"to")
            sender = header.get(b"from")
            if not (type(group) is bytes and type(instance) is bytes
                    and type(to) is bytes and type(sender) is bytes):
                self.count_malformed(f"{msg.subject.decode(errors='replace')}: routed frame "
                                "without DATA group, instance, to and from")
                continue
            remote.lname = sender
            route(remote, frame, header, origin=(server, session, first + i, stamps[i]),
                  key=(group, instance, to, b"repl" in header or b"reply" in header))
            routed += 1
        self.received += routed

    def count_malformed(self, reason: str) -> None:
        """Count a message from NATS that could not be used, and report it."""
        self.malformed += 1
        if self.on_malformed is not None:
            self.on_malformed(reason)

    def _keep(self, data: bytes) -> bool:
        self.pending.append(data)
        return True

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data
