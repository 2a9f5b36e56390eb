"""What the rest of the broker holds of the cluster: the link's status and its queries.

The ``cluster`` service (broker/cluster/cluster_service.py) drives the NATS
connection and sets ``ctx.cluster`` to a :class:`ClusterLink`; ``stats``,
the metrics, Eventer queries and Mariner replay use it.  Kept apart from the
service so that the broker's shared context can name it without importing
the trio glue that itself needs the context.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from broker.cluster import claims, peers, subjects
from broker.cluster import cluster_query as cq
from broker.cluster.backplane import Backplane
from broker.cluster.peers import Peers, new_boot
from broker.core.auth import Authenticator, Principal
from broker.core.queue import OutQueue
from broker.core.tally import counter
from wire import nats
from wire.errors import MalformedError, ProtocolError

log = logging.getLogger(__name__)

# Seconds between two pings (a broker asking who is alive): heartbeats of
# ever new server ids (forged) must not make it ping without end.
PING_INTERVAL = 0.2
# Seconds a cluster query waits for the brokers seen to answer; then it
# answers with what it has (a broker that died since its last heartbeat
# must not stall every query).  A NATS round trip on a LAN takes well
# under a millisecond, a 10,000-event answer a few tens of milliseconds.
QUERY_TIMEOUT = 2.0
# NATS servers default to this max_payload when INFO does not say.
DEFAULT_MAX_PAYLOAD = 1024 * 1024


@attrs.define(eq=False)
class ClusterStatus:
    """What ``stats`` and the metrics export about the backplane."""

    server_id: int
    up: bool = False
    url: str = ""
    connects: int = 0
    # The other brokers: heard, and proved alive (broker.cluster.peers).
    peers: Peers = attrs.field(default=attrs.Factory(
        lambda self: Peers(self.server_id), takes_self=True))
    boot: str = attrs.Factory(new_boot)

    def brokers_seen(self, now: float, heartbeat: float) -> list[int]:
        """This broker and the others heard within three heartbeats that proved alive."""
        return sorted([self.server_id, *self.peers.alive(now, 3 * heartbeat)])


@attrs.define(eq=False)
class ClusterLink:
    """The backplane and its status, for ``stats`` and the metrics."""

    backplane: Backplane
    status: ClusterStatus
    # Seconds between heartbeats ([cluster] heartbeat): a broker counts as
    # seen while its last heartbeat is younger than three of them.
    heartbeat: float = 1.0
    # Set by the service: where cluster queries run, and the NATS queue.
    nursery: trio.Nursery | None = None
    queue: OutQueue | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD
    inbox: bytes = attrs.Factory(lambda: b"_INBOX." + secrets.token_hex(8).encode() + b".")
    # reply subject -> [answers still expected, answers, done]
    pending: dict[bytes, list[Any]] = attrs.Factory(dict)
    queries: int = 0
    query_timeouts: int = 0
    # Queries from other brokers whose user claim this broker grants nothing.
    queries_refused: int = counter(
        "skan_cluster_queries_refused",
        "Queries from other brokers for a user this broker grants nothing (answered empty).")
    pings: int = 0
    _last_ping: float = -PING_INTERVAL
    # This broker's users (the answering side's permissions); set by the service.
    auth: Callable[[], Authenticator] | None = None

    def up(self) -> bool:
        return self.status.up

    def query(self, params: Any, local: cq.LocalQuery,
              done: Callable[[list[tuple], bool], None],
              principal: Principal | None = None, lname: bytes = b"") -> None:
        """Answer an Eventer query from every broker: ``done(entries, more_follows)``
        is called once, with entries carrying their server id (broker.cluster.cluster_query).
        ``principal`` and ``lname``: the asking client (the other brokers answer
        with what their configuration of its user may read)."""
        own = cq.local_answer(params, local, self.status.server_id)
        assert self.nursery is not None
        self.nursery.start_soon(self._answer_when_gathered, params, own, done,
                                _asker(principal, lname))

    async def _answer_when_gathered(self, params: Any, own: cq.Gathered,
                                    done: Callable[[list[tuple], bool], None],
                                    asker: tuple[bytes, bytes]) -> None:
        merged = cq.merge(params, await self._answers(params, own, asker))
        done(merged.entries, merged.more_follows)

    async def gather(self, params: Any, local: cq.LocalQuery,
                     principal: Principal | None = None, lname: bytes = b"") -> cq.Gathered:
        """Every broker's answer to an Eventer query, merged (broker.cluster.cluster_query)."""
        return cq.merge(params, await self._answers(
            params, cq.local_answer(params, local, self.status.server_id),
            _asker(principal, lname)))

    async def replay(self, last: Any, timestamp: float,
                     patterns: tuple[tuple[str, ...], ...],
                     local: cq.LocalQuery, principal: Principal | None = None,
                     lname: bytes = b"") -> AsyncIterator[list[tuple]]:
        """The events of a cluster-wide Mariner replay after ``last`` (whose
        timestamp is ``timestamp``), page by page from every broker, each page
        in (timestamp, EventId) order, with no cap (broker.cluster.cluster_query.ReplayPager).
        Ends early, logged, when the paging cannot move on."""
        pager = cq.ReplayPager(patterns, (timestamp, last.server, last.session, last.instance))
        while not pager.done:
            params = pager.params()
            answers = await self._answers(params, cq.local_answer(
                params, local, self.status.server_id), _asker(principal, lname))
            yield pager.take(answers)
        if pager.gap:
            log.warning("cluster: replay after %r stopped at %r: a broker keeps more than "
                        "%d events with one timestamp, or one too large for NATS",
                        last, pager.cursor, cq.QUERY_LIMIT)

    async def _answers(self, params: Any, own: cq.Gathered,
                       asker: tuple[bytes, bytes]) -> list[cq.Gathered]:
        """Every broker's answer to ``params``: ours, then those that came in
        time from the brokers that proved alive (one answer each)."""
        answers = [own]
        expected = set(self.peers_alive())
        if expected and self.status.up and self.queue is not None:
            self.queries += 1
            reply = self.inbox + b"q%d" % self.queries
            state: list[Any] = [expected, answers, trio.Event()]
            self.pending[reply] = state
            try:
                self.queue.push(nats.pub(subjects.control(subjects.QUERY, self.status.server_id),
                                         cq.encode_request(params, *asker), reply))
                with trio.move_on_after(QUERY_TIMEOUT) as scope:
                    await state[2].wait()
                if scope.cancelled_caught:
                    self.query_timeouts += 1
                    # Not waited for again until they answer a ping.
                    self.status.peers.missed(state[0])
                    log.warning("cluster: query answered by %d of %d brokers within %.1f s",
                                len(answers) - 1, len(answers) - 1 + len(state[0]),
                                QUERY_TIMEOUT)
            finally:
                del self.pending[reply]
        return answers

    def answered(self, msg: nats.Msg) -> None:
        """An answer to one of our queries or pings arrived (reader task)."""
        if msg.subject.startswith(self.inbox + b"p"):
            self._pinged(msg)
            return
        state = self.pending.get(msg.subject)
        if state is None:
            return  # too late: that query has answered already
        try:
            server, answer = cq.decode_answer(msg.payload)
        except ProtocolError as exc:
            self.backplane.count_malformed(
                f"bad query answer on {msg.subject.decode(errors='replace')}: {exc}")
            return
        if server not in state[0]:
            return  # not asked, or answered already: one answer per broker
        state[0].discard(server)
        state[1].append(answer)
        if not state[0]:
            state[2].set()

    def answer(self, local: cq.LocalQuery | None, msg: nats.Msg, refused: bool = False) -> None:
        """Another broker asks a query: answer with ``local`` (this broker's own
        store; None: it retains nothing), and only with what this broker's
        configuration of the asking user may read (``refused``: answer empty,
        counted: too many queries are waiting)."""
        if not msg.reply or self.queue is None:
            return
        asker = subjects.control_sender(msg.subject, subjects.QUERY)
        try:
            if asker is None:
                raise MalformedError("query on a subject that names no broker")
            request = cq.decode_request(msg.payload)
        except ProtocolError as exc:
            self.backplane.count_malformed(f"bad query request: {exc}")
            return
        lname = request.lname
        if lname and not subjects.owns(lname, b"%d" % asker):
            self.backplane.count_forged(f"query from broker {asker} for "
                                        f"{lname.decode(errors='replace')!r}, not its client")
            return
        perms = claims.permissions(request.claim, self.auth() if self.auth else Authenticator(),
                                   query=True)
        if refused:
            self.queries_refused += 1
            found = cq.Gathered([], True)
        elif perms is claims.NOTHING:
            self.queries_refused += 1
            log.info("cluster: query from broker %d for user %s refused: this broker grants "
                     "that user nothing", asker, claims.name(request.claim))
            found = cq.Gathered([], False)
        elif local is None:
            found = cq.Gathered([], False)
        else:
            found = cq.local_answer(request.params, local, self.status.server_id,
                                    cq.visible_to(perms, lname))
        self.queue.push(nats.pub(msg.reply, cq.encode_answer(
            found, self.max_payload - cq.PAYLOAD_MARGIN, self.status.server_id)))

    # ---- who is alive ---------------------------------------------------------

    def peers_alive(self) -> list[int]:
        return self.status.peers.alive(trio.current_time(), 3 * self.heartbeat)

    def heard(self, subject: bytes, payload: bytes) -> None:
        """A heartbeat (reader task): checked, bounded, and a ping when a broker
        is new or restarted."""
        backplane, status = self.backplane, self.status
        named = subjects.control_sender(subject, subjects.HEARTBEAT)
        try:
            if named is None:
                raise MalformedError("heartbeat on a subject that names no broker")
            server, boot = peers.decode_hello(payload)
        except ProtocolError as exc:
            backplane.count_malformed(f"{subject.decode(errors='replace')}: {exc}")
            return
        if server != named:
            backplane.count_forged(f"{subject.decode(errors='replace')}: heartbeat of "
                                   f"broker {server}")
            return
        if server == status.server_id:
            return
        now = trio.current_time()
        verdict = status.peers.heard(server, boot, now, 3 * self.heartbeat)
        if verdict == peers.REFUSED:
            return
        if verdict == peers.RESTARTED:
            backplane.peer_restarted(server, now)
        backplane.remote.heard(server, now)
        if verdict != peers.KNOWN or not status.peers.is_proven(server):
            self.ping(now)

    def ping(self, now: float) -> None:
        """Ask every broker to prove it is alive (at most once per PING_INTERVAL)."""
        if now - self._last_ping < PING_INTERVAL or self.queue is None:
            return
        self._last_ping = now
        self.pings += 1
        self.queue.push(nats.pub(subjects.control(subjects.PING, self.status.server_id), b"",
                                 self.inbox + b"p%d" % self.pings))

    def pinged(self, msg: nats.Msg) -> None:
        """Another broker asks who is alive: say who we are (reader task)."""
        if msg.reply and self.queue is not None:
            self.queue.push(nats.pub(msg.reply, peers.encode_hello(self.status.server_id,
                                                                   self.status.boot)))

    def _pinged(self, msg: nats.Msg) -> None:
        try:
            server, boot = peers.decode_hello(msg.payload)
        except ProtocolError as exc:
            self.backplane.count_malformed(f"bad ping answer: {exc}")
            return
        self.status.peers.proved(server, boot)

    def brokers(self) -> list[int]:
        """Server ids of the brokers seen, this one included."""
        return self.status.brokers_seen(trio.current_time(), self.heartbeat)

    def stats(self) -> dict[str, Any]:
        """The ``cluster`` HASH of the Skan ``stats`` reply."""
        bp, status = self.backplane, self.status
        counts = bp.stats
        # The backplane counts when the router hands a batch over: a stats
        # request must count what its own batch routed before it.
        bp.router.hand_over()
        brokers = self.brokers()
        return {
            "server_id": status.server_id,
            "up": int(status.up),
            "url": status.url,
            "connects": status.connects,
            "brokers_seen": len(brokers),
            "brokers": [b"%d" % b for b in brokers],
            "backplane_out": counts.sent,
            "backplane_in": counts.received,
            "backplane_drops": counts.drops,
            "backplane_withheld": counts.withheld,
            "interest": bp.remote.state,
            "duplicates": counts.duplicates,
            "malformed": counts.malformed,
            "forged": counts.forged,
            "refused": counts.refused,
            "oversized_in": counts.oversized_in,
            "peers_refused": status.peers.refused,
            "interest_refused": bp.remote.refused,
            "hellos_deferred": counts.hellos_deferred,
            "queries_refused": self.queries_refused,
        }


def _asker(principal: Principal | None, lname: bytes) -> tuple[bytes, bytes]:
    """The claim and lname a query carries for the asking client."""
    return claims.claim(principal), lname
