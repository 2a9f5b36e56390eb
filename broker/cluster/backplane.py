"""The NATS backplane as one more routing endpoint (pure: no trio, no sockets).

Out: the backplane observes every routing batch.  The messages that entered
this broker (their sender is not the backplane) are published on their
subjects (:mod:`broker.cluster.subjects`), byte-identical, in *runs*
(:mod:`broker.cluster.subject_runs`): the consecutive messages of a batch that
share a subject travel as one NATS message.  So NATS, and the parsing on both brokers, pay their
per-message cost once per run, not once per Skan message; a lone message is
a run of one.  The whole batch goes to NATS in one write.  Even a message
directed to one of this broker's own clients goes out when a promisc or
pattern subscriber on another broker may take it.  What no other broker
wants stays here: the brokers announce their aggregated interest to each
other (:mod:`broker.cluster.interest`), and a run is published only when
its group is wanted elsewhere, some broker wants everything, it is
directed to an lname another broker owns, or some broker's interest is
unknown (then everything goes out, as without this knowledge).  The check
costs one lookup per run (per batch on the one-subject fast path).

In: each frame of a run from NATS is routed to this broker's own endpoints
only, with the backplane as sender (so it never goes back out: "never to the
sender" is the loop guard), its origin's EventId and timestamp, and the
rules of section 1 applied again to the decoded header: the subject was
only a pre-filter.  Overlapping NATS subscriptions (a group's and our own
directed-traffic subject) deliver one run twice, one right after the other;
a window of the last runs seen per origin broker (bounded, reset when that
broker restarts) drops the second copy.  A window, not a high-water mark: a
forged run with a huge session can only occupy one slot of it, never make
later runs look old.  What cannot be decoded is counted in ``malformed`` and
reported to ``on_malformed`` (the service logs it, rate limited).

Trust (BROKER-SPEC section 8, "What a broker believes from NATS"): a run is
accepted only if the subject's publisher (``sk.<server>.``), the run's
origin and every frame's ``from`` (an lname ``...@HOST/<server>``) name the
same broker (else counted in ``forged``); frames over ``max_frame`` are
refused (``oversized_in``); the run's user claim (:mod:`broker.cluster.claims`)
gets this broker's permissions for that user, so a send that user may not
make here is refused (``refused``, and skan_permission_denied_total).

Interest: the backplane keeps one NATS subscription per group with local
subscribers (aggregated, not per instance), one for every group when a Hat
pattern's first segment is a wildcard, and one for traffic directed to its
own clients; it announces the first two on :data:`subjects.INTEREST` ``<server>`` (a
delta when one is made or removed, the full set from :meth:`announce`).
Protocol bytes go to ``send`` (the trio driver's queue towards NATS,
which returns False when it cannot take them: NATS is down or slower
than this broker, and the messages are counted in ``drops``); by default
they collect in ``pending`` (the pure tests read them there).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import attrs

from broker.cluster import claims, inbound, interest, subjects
from broker.cluster import subject_runs as runs
from broker.cluster.subject_runs import (
    HEADER_ROOM,
    RUN_BYTES,
    STAMP,
    encode_run,
    pack_stamps,
    unpack_run,
)
from broker.core.enforcement import set_permissions
from broker.core.eventtypes import STAR, pattern_group
from broker.core.refusals import NotPermitted
from broker.core.router import Endpoint, Routed, Router
from broker.core.tally import COUNTER, Family, counter
from wire import nats
from wire.errors import LimitError, ProtocolError
from wire.skan import decode_header

# Distinct (group, instance, to) subjects remembered; cleared when full (as
# the router's recipient cache): directed traffic to many lnames must not
# grow it without bound.
SUBJECT_CACHE_LIMIT = 65_536
# Remote senders (one per remote client lname) remembered; cleared when full,
# for the same reason: clients on other brokers come and go without end.
SENDER_CACHE_LIMIT = 65_536
# Runs remembered per origin broker to drop the second copy overlapping
# subscriptions deliver (it arrives right after the first).
DEDUPE_WINDOW = 1024
# Seconds between two answers to a hello: every broker announces its full
# set with each heartbeat anyway, so answering a burst of hellos (2,000
# forged ones, say) with one full set each is work for nothing.
HELLO_INTERVAL = 0.1
# Frames the broker accepts from NATS when the router has no max_frame.
DEFAULT_MAX_FRAME = 8 * 1024 * 1024
# Field getters, for C-level passes over a batch (Backplane._unwanted).
_HEADER_OF = attrgetter("header")
_GROUP = itemgetter(b"group")
_TO = itemgetter(b"to")


# Routed messages published to and received from NATS: one family, two series.
MESSAGES = Family(COUNTER, "skan_backplane_messages",
                  "Routed messages published to (out) and received from (in) the NATS "
                  "backplane.", labels=("direction",))


@attrs.define
class BackplaneStats:
    """The backplane's counters (``stats`` and, as declared, the metrics)."""

    sent: int = MESSAGES.field("out")
    received: int = MESSAGES.field("in")
    drops: int = counter(
        "skan_backplane_drops",
        "Messages not published to the backplane (NATS down or its queue full).")
    duplicates: int = counter(
        "skan_backplane_duplicates",
        "Second copies of a message from the backplane, dropped (overlapping NATS "
        "subscriptions, reconnects).")
    # Messages not published: no other broker wanted them.
    withheld: int = counter(
        "skan_backplane_withheld",
        "Messages not published because no other broker of the cluster wants them "
        "(announced interest).")
    malformed: int = counter(
        "skan_backplane_malformed",
        "Messages from the backplane that could not be decoded, dropped.")
    # Section 8, "What a broker believes from NATS".  Messages that spoke for
    # another broker than the one that published them (subject, origin and
    # frames' from disagree).
    forged: int = counter(
        "skan_backplane_forged",
        "Messages from the backplane that spoke for another broker than the one whose "
        "subject they came on (origin or a frame's from), refused.")
    # Messages the claimed user may not send here (section 7 on this broker).
    refused: int = counter(
        "skan_backplane_refused",
        "Messages from the backplane that the user they claim may not send on this broker "
        "(its [[users]]), refused.")
    # Runs holding a frame over max_frame (also in malformed).
    oversized_in: int = counter(
        "skan_backplane_oversized_in",
        "Runs from the backplane holding a frame over max_frame, refused.")
    # Messages too large for NATS's max_payload (counted in drops too).
    oversized: int = 0
    # Hellos not answered at once (HELLO_INTERVAL; the next heartbeat's full set does).
    hellos_deferred: int = 0


class RemoteSender(Endpoint):
    """The sender of a message that arrived over the backplane (never a recipient):
    one per remote client lname."""

    protocol = "cluster"

    def __init__(self, lname: bytes = b"") -> None:
        super().__init__()
        self.lname = lname

    def deliver(self, frame: bytes, routed: Routed) -> None:  # pragma: no cover - never called
        pass


class Backplane(Endpoint):
    """This broker's side of the backplane: publishes, subscribes, dedupes."""

    protocol = "cluster"

    def __init__(self, router: Router, server_id: int, heartbeat: float = 1.0) -> None:
        super().__init__()
        self.router = router
        self.server_id = server_id
        self.lname = b"backplane/%d" % server_id
        self.pending: list[bytes] = []
        self.send: Callable[[bytes], bool] = self._keep
        # subject -> (sid, reference count)
        self._subs: dict[bytes, list[Any]] = {}
        self._next_sid = 0
        # origin server id -> its last runs' (session, first, count) (DEDUPE_WINDOW)
        self._recent: dict[int, dict[tuple[int, int, int], None]] = {}
        self.stats = BackplaneStats()
        self._last_hello = -HELLO_INTERVAL
        self.max_frame = router.max_frame or DEFAULT_MAX_FRAME
        self._auth = router.enforcer.auth
        # NATS's max_payload (its INFO; the service sets it per connection).
        self.max_payload = nats.DEFAULT_MAX_PAYLOAD
        self.on_malformed: Callable[[str], None] | None = None
        self._senders: dict[tuple[bytes, bytes], RemoteSender] = {}
        # (group, instance, to) -> (subject, directed to another broker's lname)
        self._subjects: dict[tuple[bytes, bytes, bytes], tuple[bytes, bool]] = {}
        self._in_runs = 0  # messages the last observe() put in runs
        # Local interest announced to the other brokers: NATS subject -> group
        # (None: everything), for the subjects of _subs that carry interest.
        self._interest: dict[bytes, bytes | None] = {}
        self.announcer = interest.Announcer(server_id)
        # Blind after (re)connecting for two heartbeats (every broker announces
        # its full set with each heartbeat); forgotten after three (as "brokers seen").
        self.remote = interest.RemoteInterest(server_id, 2 * heartbeat, 3 * heartbeat)
        self._own_dest = b"b%d" % server_id
        self._interest_subject = subjects.control(subjects.INTEREST, server_id)
        # Only what entered this broker: what NATS brought never goes back out
        # (the router leaves it out of local observers' batches, or calls none).
        router.local_observers.append(self.observe)
        router.interest.append(self.interest_changed)
        self._add(subjects.own_interest(server_id))

    # ---- out -------------------------------------------------------------

    def observe(self, batch: list[Routed]) -> None:
        """Local router observer: publish, in runs and in one write, the batch
        (the messages that entered this broker)."""
        wanted = self.remote.wanted
        parts: list[bytes] = []
        found = runs.batch_key(batch, self.server_id)
        if found is not None:
            # The common batch (one C pass over it): this broker's messages on
            # one subject; withheld, or one run when consecutive.
            subject, away = self._subject(found[:3])
            if wanted is not None and not away and found[0] not in wanted:
                self.stats.withheld += len(batch)
                return
            if not (found[3] and self._one_run(batch, subject, parts)):
                self._runs(batch, parts, wanted)
        else:
            if wanted is not None and self._unwanted(batch, wanted):
                return
            self._runs(batch, parts, wanted)
        if parts:
            sent = self._in_runs
            if self.send(b"".join(parts)):
                self.stats.sent += sent
            else:
                self.stats.drops += sent

    def _unwanted(self, batch: list[Routed], wanted: set[bytes]) -> bool:
        """A local batch of several subjects, in C-level calls and no allocation
        per message: broadcasts on one group no other broker wants (counted in
        ``withheld``).  False (nothing done) for any other batch."""
        headers = list(map(_HEADER_OF, batch))
        groups = list(map(_GROUP, headers))
        group, n = groups[0], len(groups)
        if group in wanted or groups.count(group) != n or list(map(_TO, headers)).count(STAR) != n:
            return False
        self.stats.withheld += n
        return True

    def _one_run(self, batch: list[Routed], subject: bytes, parts: list[bytes]) -> bool:
        """A batch that is one run of one subject (one session, consecutive
        instances, one sender: one publisher's read), cut at RUN_BYTES.  False (nothing
        done) when a frame is too large for NATS: the general path drops it."""
        head, n = batch[0], len(batch)
        frames, ends, stamps, largest = runs.run_parts(batch)
        if largest > self.max_payload - HEADER_ROOM - STAMP:
            return False
        claim = claims.claim(head.sender.principal)
        server, session, first = head.server, head.session, head.instance
        i = done = 0
        while i < n:
            j = max(bisect_right(ends, done + RUN_BYTES, i), i + 1)  # ends: payload bytes so far
            parts += encode_run(subject, server, session, first + i, stamps[STAMP * i:STAMP * j],
                                frames[i:j], ends[j - 1] - done, claim)
            done = ends[j - 1]
            i = j
        self._in_runs = n
        return True

    def _runs(self, batch: list[Routed], parts: list[bytes],
              wanted: set[bytes] | None) -> None:
        """Any batch, message by message: a run ends where the subject, the
        origin's session, the sender or the instance sequence changes, or at
        RUN_BYTES.
        Whether another broker wants a subject is decided once per stretch of
        messages on it."""
        largest = self.max_payload - HEADER_ROOM  # a run of one must fit
        frames: list[bytes] = []
        stamps: list[float] = []
        subject = checked = b""
        skip = False
        sender: Endpoint | None = None
        server = session = first = nxt = size = 0
        sent = withheld = 0
        for routed in batch:
            header = routed.header
            group = header[b"group"]
            subj, away = self._subject((group, header[b"instance"], header[b"to"]))
            if subj != checked:
                checked = subj
                skip = wanted is not None and not away and group not in wanted
            if skip:
                withheld += 1
                continue
            frame = routed.frame
            n = len(frame) + STAMP
            if n > largest:
                self.stats.drops += 1  # NATS would refuse it and close the connection
                self.stats.oversized += 1
                continue
            if (subj != subject or routed.instance != nxt or routed.session != session
                    or routed.server != server or routed.sender is not sender
                    or size + n > RUN_BYTES):
                if frames:
                    parts += encode_run(subject, server, session, first, pack_stamps(stamps),
                                        frames, size, claims.claim(sender.principal))
                    sent += len(frames)
                    frames = []
                    stamps = []
                subject = subj
                sender = routed.sender
                server = routed.server
                session = routed.session
                first = nxt = routed.instance
                size = 0
            frames.append(frame)
            stamps.append(routed.timestamp)
            nxt += 1
            size += n
        if frames:
            assert sender is not None
            parts += encode_run(subject, server, session, first, pack_stamps(stamps), frames, size,
                                claims.claim(sender.principal))
            sent += len(frames)
        self._in_runs = sent
        self.stats.withheld += withheld

    def _subject(self, key: tuple[bytes, bytes, bytes]) -> tuple[bytes, bool]:
        """The subject of (group, instance, to), and whether it is directed to an
        lname another broker owns (that broker always subscribes to it)."""
        cache = self._subjects
        found = cache.get(key)
        if found is None:
            if len(cache) >= SUBJECT_CACHE_LIMIT:
                cache.clear()
            subject = subjects.message_subject(self.server_id, *key)
            dest = subject[subject.rfind(b".") + 1:]
            found = cache[key] = (subject, dest[:1] == b"b" and dest != self._own_dest)
        return found

    def deliver(self, frame: bytes, routed: Routed) -> None:
        """The backplane is never a local recipient (it holds no subscriptions)."""

    # ---- interest --------------------------------------------------------

    def interest_changed(self, key: tuple[bytes, ...] | bytes, added: bool) -> None:
        """A group (bytes) or Hat pattern (tuple) gained its first / lost its last subscriber."""
        group = pattern_group(key) if isinstance(key, tuple) else key
        subject = subjects.ALL_INTEREST if group is None else subjects.group_interest(group)
        if added:
            if self._add(subject):
                self._interest[subject] = group
                self._announce_delta(group, True)
        elif self._drop(subject):
            del self._interest[subject]
            self._announce_delta(group, False)

    def _add(self, subject: bytes) -> bool:
        """Count one more holder of ``subject``; True when it is new (SUB sent)."""
        entry = self._subs.get(subject)
        if entry is not None:
            entry[1] += 1
            return False
        self._next_sid += 1
        sid = b"%d" % self._next_sid
        self._subs[subject] = [sid, 1]
        self.send(nats.sub(subject, sid))  # if lost, resubscribe() restores it
        return True

    def _drop(self, subject: bytes) -> bool:
        """One holder fewer; True when it was the last (UNSUB sent)."""
        entry = self._subs.get(subject)
        if entry is None:
            return False
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del self._subs[subject]
        self.send(nats.unsub(entry[0]))
        return True

    def _announce_delta(self, group: bytes | None, added: bool) -> None:
        # After the SUB (same connection, so NATS has it before anyone can act
        # on the delta).  If it is lost, the receivers see a gap in the
        # sequence and publish everything until our next full set.
        self.send(nats.pub(self._interest_subject, self.announcer.delta(group, added)))

    def announce(self, hello: bool = False) -> None:
        """Send this broker's full interest (``hello``: on a fresh connection, asking
        every other broker for theirs)."""
        groups = [g for g in self._interest.values() if g is not None]
        everything = None in self._interest.values()
        part = min(interest.PART_BYTES, self.max_payload // 2)
        for payload in self.announcer.full(groups, everything, hello, part):
            self.send(nats.pub(self._interest_subject, payload))

    def connected(self, now: float) -> None:
        """A fresh NATS connection (subscriptions restored): forget what the
        other brokers wanted, and say hello with our own full set."""
        self.remote.reset(now)
        self.announce(hello=True)

    def interest_received(self, payload: bytes, now: float,
                          subject: bytes | None = None) -> None:
        """An interest message from another broker, on ``subject`` (which names
        it); a hello is answered at most once per HELLO_INTERVAL (the
        heartbeat's full set answers the others)."""
        sender = None
        if subject is not None:
            sender = subjects.control_sender(subject, subjects.INTEREST)
            if sender is None:
                self.count_malformed(f"{subject.decode(errors='replace')}: not a broker's subject")
                return
        try:
            hello = self.remote.receive(payload, now, sender)
        except interest.ForgedError as exc:
            self.count_forged(f"{subject.decode(errors='replace') if subject else ''}: {exc}")
            return
        except ProtocolError as exc:
            self.count_malformed(f"{(subject or b'').decode(errors='replace')}: {exc}")
            return
        if hello:
            if now - self._last_hello >= HELLO_INTERVAL:
                self._last_hello = now
                self.announce()
            else:
                self.stats.hellos_deferred += 1

    def interest_lost(self, subject: bytes, now: float) -> None:
        """An interest message dropped unread (the backlog was full): its
        sender's set is unknown until its next full set."""
        self.count_malformed(f"{subject.decode(errors='replace')}: dropped, interest backlog full")
        sender = subjects.control_sender(subject, subjects.INTEREST)
        if sender is not None:
            self.remote.lost(sender, now)

    def peer_restarted(self, server: int, now: float) -> None:
        """``server`` came back with a new boot id: its dedupe window and its
        announced interest belong to its previous life."""
        self._recent.pop(server, None)
        self.remote.restarted(server, now)

    def resubscribe(self) -> list[bytes]:
        """Commands that restore every subscription on a fresh NATS connection."""
        return [nats.sub(subject, sid) for subject, (sid, _) in self._subs.items()]

    @property
    def subjects(self) -> set[bytes]:
        return set(self._subs)

    # ---- in --------------------------------------------------------------

    def receive(self, msg: nats.Msg) -> None:
        """Route one run from NATS to this broker's own endpoints."""
        subject = msg.subject
        try:
            server, session, first, stamps, frames, claim = unpack_run(msg, self.max_frame)
        except LimitError as exc:
            self.stats.oversized_in += 1
            self.count_malformed(f"{subject.decode(errors='replace')}: {exc}")
            return
        except ProtocolError as exc:
            self.count_malformed(f"{subject.decode(errors='replace')}: {exc}")
            return
        publisher = subjects.publisher(subject)
        if publisher is None or publisher != b"%d" % server:
            self.count_forged(f"{subject.decode(errors='replace')}: run of broker {server} "
                              "on a subject of another")
            return
        if server == self.server_id:
            return  # our own message (echo is off; a misconfigured peer id)
        recent = self._recent.get(server)
        if recent is None:
            if len(self._recent) >= interest.MAX_PEERS:
                self._recent.clear()  # made-up origins: at worst a second copy passes
            recent = self._recent[server] = {}
        seen = (session, first, len(frames))
        if seen in recent:
            self.stats.duplicates += len(frames)
            return
        recent[seen] = None
        if len(recent) > DEDUPE_WINDOW:
            del recent[next(iter(recent))]
        if self._auth is not self.router.enforcer.auth:
            self._auth = self.router.enforcer.auth  # reloaded: senders get the new permissions
            self._senders.clear()
        found = inbound.run_key(frames)
        if found is not None:
            # The common run: one publisher's sends on one routing key.
            lname, headers, key = found
            if self._forged_sender(subject, lname, publisher):
                return
            try:
                self.router.route_run(self._sender(lname, claim), frames, headers, key,
                                      (server, session, first), stamps)
            except NotPermitted:
                self.stats.refused += len(frames)
                return
            self.stats.received += len(frames)
        else:
            self.route_frames(subject, server, session, first, stamps, frames, claim)

    def route_frames(self, subject: bytes, server: int, session: int, first: int,
                     stamps: Sequence[float], frames: list[bytes],
                     claim: bytes = claims.FULL) -> None:
        """Route a run frame by frame (any run: mixed keys or senders, frames
        that are not sends), dropping and counting the malformed, forged and
        refused ones."""
        route = self.router.route
        token = b"%d" % server
        routed = 0
        for i, frame in enumerate(frames):
            try:
                header = decode_header(frame, 4)
            except ProtocolError as exc:
                self.count_malformed(f"{subject.decode(errors='replace')}: {exc}")
                continue
            group = header.get(b"group")
            instance = header.get(b"instance")
            to = header.get(b"to")
            sender = header.get(b"from")
            if not (type(group) is bytes and type(instance) is bytes
                    and type(to) is bytes and type(sender) is bytes):
                self.count_malformed(f"{subject.decode(errors='replace')}: routed frame "
                                     "without DATA group, instance, to and from")
                continue
            if self._forged_sender(subject, sender, token):
                continue
            try:
                route(self._sender(sender, claim), frame, header,
                      origin=(server, session, first + i, stamps[i]),
                      key=(group, instance, to, b"repl" in header or b"reply" in header))
            except NotPermitted:
                self.stats.refused += 1
                continue
            routed += 1
        self.stats.received += routed

    def _sender(self, lname: bytes, claim: bytes = claims.FULL) -> RemoteSender:
        """The sender of messages from the remote client ``lname`` whose user
        claim is ``claim`` (one object per pair: observers such as the routing
        log key caches on the sender), with this broker's permissions for it."""
        senders = self._senders
        found = senders.get((lname, claim))
        if found is None:
            if len(senders) >= SENDER_CACHE_LIMIT:
                senders.clear()
            found = senders[(lname, claim)] = RemoteSender(lname)
            set_permissions(found, claims.permissions(claim, self.router.enforcer.auth))
        return found

    def count_forged(self, reason: str) -> None:
        """Count a message that spoke for another broker than its publisher."""
        self.stats.forged += 1
        if self.on_malformed is not None:
            self.on_malformed("forged: " + reason)

    def _forged_sender(self, subject: bytes, lname: bytes, publisher: bytes) -> bool:
        """True, counted and reported, when ``lname`` is not a client of the
        publishing broker (``publisher``: its server id's digits)."""
        if subjects.owns(lname, publisher):
            return False
        self.count_forged(f"{subject.decode(errors='replace')}: frame from "
                          f"{lname.decode(errors='replace')!r}, not a client of "
                          f"broker {publisher.decode()}")
        return True

    def count_malformed(self, reason: str) -> None:
        """Count a message from NATS that could not be used, and report it."""
        self.stats.malformed += 1
        if self.on_malformed is not None:
            self.on_malformed(reason)

    def _keep(self, data: bytes) -> bool:
        self.pending.append(data)
        return True

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data
