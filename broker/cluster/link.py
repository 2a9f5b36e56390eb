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

from broker.cluster import cluster_query as cq
from broker.cluster.backplane import Backplane
from broker.core.queue import OutQueue
from wire import nats
from wire.errors import ProtocolError

log = logging.getLogger(__name__)

# Eventer queries asked of every broker; answers come to the asker's inbox.
QUERY_SUBJECT = b"skc.query"
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
    # server id -> trio time of its last heartbeat
    seen: dict[int, float] = attrs.Factory(dict)

    def brokers_seen(self, now: float, heartbeat: float) -> list[int]:
        return sorted([self.server_id, *(s for s, t in self.seen.items()
                                         if now - t < 3 * heartbeat)])


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

    def up(self) -> bool:
        return self.status.up

    def query(self, params: Any, local: cq.LocalQuery,
              done: Callable[[list[tuple], bool], None]) -> None:
        """Answer an Eventer query from every broker: ``done(entries, more_follows)``
        is called once, with entries carrying their server id (broker.cluster.cluster_query)."""
        own = cq.local_answer(params, local, self.status.server_id)
        assert self.nursery is not None
        self.nursery.start_soon(self._answer_when_gathered, params, own, done)

    async def _answer_when_gathered(self, params: Any, own: cq.Gathered,
                                    done: Callable[[list[tuple], bool], None]) -> None:
        merged = await self._gather(params, own)
        done(merged.entries, merged.more_follows)

    async def gather(self, params: Any, local: cq.LocalQuery) -> cq.Gathered:
        """Every broker's answer to an Eventer query, merged (broker.cluster.cluster_query)."""
        return await self._gather(params, cq.local_answer(params, local,
                                                          self.status.server_id))

    async def replay(self, last: Any, timestamp: float,
                     patterns: tuple[tuple[str, ...], ...],
                     local: cq.LocalQuery) -> AsyncIterator[list[tuple]]:
        """The events of a cluster-wide Mariner replay after ``last`` (whose
        timestamp is ``timestamp``), page by page from every broker, each page
        in (timestamp, EventId) order, with no cap (broker.cluster.cluster_query.ReplayPager).
        Ends early, logged, when the paging cannot move on."""
        pager = cq.ReplayPager(patterns, (timestamp, last.server, last.session, last.instance))
        while not pager.done:
            params = pager.params()
            answers = await self._answers(params, cq.local_answer(
                params, local, self.status.server_id))
            yield pager.take(answers)
        if pager.gap:
            log.warning("cluster: replay after %r stopped at %r: a broker keeps more than "
                        "%d events with one timestamp, or one too large for NATS",
                        last, pager.cursor, cq.QUERY_LIMIT)

    async def _gather(self, params: Any, own: cq.Gathered) -> cq.Gathered:
        return cq.merge(params, await self._answers(params, own))

    async def _answers(self, params: Any, own: cq.Gathered) -> list[cq.Gathered]:
        """Every broker's answer to ``params``: ours, then those that came in time."""
        answers = [own]
        expected = len(self.brokers()) - 1
        if expected > 0 and self.status.up and self.queue is not None:
            self.queries += 1
            reply = self.inbox + b"%d" % self.queries
            state: list[Any] = [expected, answers, trio.Event()]
            self.pending[reply] = state
            try:
                self.queue.push(nats.pub(QUERY_SUBJECT, cq.encode_request(params), reply))
                with trio.move_on_after(QUERY_TIMEOUT) as scope:
                    await state[2].wait()
                if scope.cancelled_caught:
                    self.query_timeouts += 1
                    log.warning("cluster: query answered by %d of %d brokers within %.1f s",
                                len(answers) - 1, expected, QUERY_TIMEOUT)
            finally:
                del self.pending[reply]
        return answers

    def answered(self, msg: nats.Msg) -> None:
        """An answer to one of our queries arrived (reader task)."""
        state = self.pending.get(msg.subject)
        if state is None:
            return  # too late: that query has answered already
        try:
            state[1].append(cq.decode_answer(msg.payload))
        except ProtocolError as exc:
            self.backplane.count_malformed(
                f"bad query answer on {msg.subject.decode(errors='replace')}: {exc}")
        state[0] -= 1
        if state[0] <= 0:
            state[2].set()

    def answer(self, local: cq.LocalQuery | None, msg: nats.Msg) -> None:
        """Another broker asks a query: answer with ``local`` (this broker's own
        store; None: it retains nothing) (reader task)."""
        if not msg.reply or self.queue is None:
            return
        try:
            params = cq.decode_request(msg.payload)
        except ProtocolError as exc:
            self.backplane.count_malformed(f"bad query request: {exc}")
            return
        if local is None:
            found = cq.Gathered([], False)
        else:
            found = cq.local_answer(params, local, self.status.server_id)
        self.queue.push(nats.pub(msg.reply, cq.encode_answer(
            found, self.max_payload - cq.PAYLOAD_MARGIN)))

    def brokers(self) -> list[int]:
        """Server ids of the brokers seen, this one included."""
        return self.status.brokers_seen(trio.current_time(), self.heartbeat)

    def stats(self) -> dict[str, Any]:
        """The ``cluster`` HASH of the Skan ``stats`` reply."""
        bp, status = self.backplane, self.status
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
            "backplane_out": bp.sent,
            "backplane_in": bp.received,
            "backplane_drops": bp.drops,
            "backplane_withheld": bp.withheld,
            "interest": bp.remote.state,
            "duplicates": bp.duplicates,
            "malformed": bp.malformed,
        }
