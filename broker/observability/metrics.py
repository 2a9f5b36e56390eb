"""Prometheus metrics of a running broker, built at scrape time from plain counters.

The routing path only bumps plain ints (``router.counters``, per-endpoint
counts, ``router.group_stats``, ``router.latency``); a
:class:`BrokerCollector` on a private :class:`CollectorRegistry` turns them
into metric families when Prometheus scrapes.  ``labels().inc()`` on the
hot path would cost as much as routing the message itself.

Every metric is named ``skan_*`` and listed, with its meaning, in
docs/metrics.md.  Label values come from fixed sets (protocol names, close
and error reasons the code chooses, configured bridge names) except the
``group`` label, which is bounded by the [metrics] allow-list plus top-N.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from broker.cluster.backplane import BackplaneStats
from broker.cluster.link import ClusterLink
from broker.cluster.peers import Peers
from broker.core.queue import QueuedEndpoint
from broker.core.reasons import LISTENER_PROTOCOLS, CloseReason, ErrorKind, RefusalReason
from broker.core.router import Router
from broker.core.tally import COUNTER, described
from broker.observability.latency import RouteLatency
from broker.observability.routelog.writer import RoutingLog
from broker.serving import hostloop
from broker.serving.bridge_runner import BridgeStatus, BufferedBridgeEndpoint
from broker.store import Store

if TYPE_CHECKING:
    from broker.serving.context import BrokerContext

# Groups whose counts are kept between scrapes.  Group names are chosen by
# clients, so the table is pruned back to the allow-list plus the busiest
# groups whenever it grows past this (see prune_group_stats); a pruned
# group that comes back starts from 0, which Prometheus sees as a counter
# reset.
GROUP_TRACK_LIMIT = 10_000


def _label(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def _split(key: str) -> tuple[str, str]:
    """ "protocol:reason" -> (protocol, reason)."""
    protocol, _, reason = key.partition(":")
    return protocol, reason


def exported_groups(
    stats: dict[bytes, list[int]], allowed: Iterable[bytes], top: int
) -> list[bytes]:
    """The groups that get their own series: the allow-list plus the ``top`` busiest."""
    chosen = dict.fromkeys(allowed)
    if top:
        busiest = heapq.nlargest(top, stats.items(), key=lambda item: item[1][0])
        chosen.update(dict.fromkeys(g for g, _ in busiest))
    return list(chosen)


def prune_group_stats(
    stats: dict[bytes, list[int]], allowed: Iterable[bytes], top: int,
    limit: int = GROUP_TRACK_LIMIT,
) -> None:
    """Bound the per-group table: keep allowed groups and the busiest ones."""
    if len(stats) <= limit:
        return
    # Keep more than ``top`` so groups near the top do not restart from zero.
    keep = set(allowed)
    keep.update(g for g, _ in heapq.nlargest(max(top * 10, limit // 10), stats.items(),
                                             key=lambda item: item[1][0]))
    for group in [g for g in stats if g not in keep]:
        del stats[group]


class BrokerCollector(Collector):
    """Reads a broker's counters when Prometheus scrapes."""

    def __init__(self, ctx: BrokerContext, protocols: Iterable[str] = ("skan",),
                 errors: Mapping[str, Iterable[str]] | None = None) -> None:
        self.ctx = ctx
        cfg = ctx.config.metrics
        self.allowed = tuple(g.encode() for g in cfg.groups)
        self.top = cfg.top_groups
        # Protocols whose series exist (at 0) before their first connection, so
        # the first increase is visible to rate() and dashboards have a line.
        self.protocols = tuple(protocols)
        # "protocol:reason" keys that exist at 0 from the first scrape, so
        # rate() sees the first event and dashboards draw 0, not "no data":
        # every close reason and every error kind (broker.core.reasons) of
        # every protocol served, every refusal of every listener, plus the
        # ``errors`` of listeners that are not routing endpoints (the metrics
        # endpoint's own faults).
        self.closed_keys = _keys(self.protocols, CloseReason)
        self.error_keys = _keys(self.protocols, ErrorKind) + tuple(
            f"{p}:{r}" for p, reasons in (errors or {}).items() for r in reasons)
        self.refused_keys = _keys([p for p in self.protocols if p in LISTENER_PROTOCOLS],
                                  RefusalReason)

    def collect(self) -> Iterator[Metric]:
        ctx = self.ctx
        router: Router = ctx.router
        per = router.per_protocol()
        for proto in self.protocols:
            per.setdefault(proto, dict.fromkeys(
                ("connections", "accepted", "msgs_in", "bytes_in", "msgs_out", "bytes_out",
                 "dropped"), 0))
        per = dict(sorted(per.items()))
        yield from self._connections(router, per)
        yield from self._traffic(router, per)
        yield from self._security(router)
        yield from self._queues(router)
        latency = router.latency
        if isinstance(latency, RouteLatency):
            yield HistogramMetricFamily(
                "skan_routing_latency_seconds",
                "Time from a received chunk's arrival to each of its messages being queued "
                "to every recipient.",
                buckets=latency.cumulative(),
                sum_value=latency.sum,
            )
        yield _gauge("skan_subscriptions", "Subscriptions held (instance and pattern).",
                     router.subscription_count)
        yield _gauge("skan_groups", "Groups with at least one instance subscription.",
                     router.group_count)
        yield from self._groups(router)
        yield from self._bridges(ctx.bridges, router)
        yield from self._routelog(ctx.routelog)
        yield from self._cluster(ctx)
        retention = ctx.retention
        if retention is not None:
            yield _gauge("skan_retention_messages", "Routed messages held in the retention store.",
                         len(retention))
            yield _counter("skan_retention_evicted_messages",
                           "Messages evicted from the full retention store (oldest first).",
                           retention.evicted)
            yield from _store(retention)
        host = hostloop.current()
        yield _counter("skan_host_loop_reads",
                       "Reads routed straight from the broker's epoll loop, without a trio "
                       "task switch ([broker] host_loop; docs/architecture.md).",
                       0 if host is None else host.hot_reads)
        yield _gauge("skan_uptime_seconds", "Seconds since the broker started.",
                     router.clock() - router.started)

    # -- families --------------------------------------------------------------

    def _connections(self, router: Router, per: dict[str, dict[str, int]]) -> Iterator[Metric]:
        c = router.counters
        open_ = GaugeMetricFamily("skan_connections_open", "Open connections (bridges included).",
                                  labels=["protocol"])
        accepted = CounterMetricFamily("skan_connections_accepted",
                                       "Connections accepted (bridge endpoints attached).",
                                       labels=["protocol"])
        for proto, v in per.items():
            open_.add_metric([proto], v["connections"])
            accepted.add_metric([proto], v["accepted"])
        yield open_
        yield accepted
        yield _by_key("skan_connections_closed", "Connections closed, by reason.", "reason",
                      self.closed_keys, c.closed)
        errors = _by_key("skan_protocol_errors", "Protocol errors (malformed or refused input).",
                         "reason", self.error_keys, c.errors)
        labelled = sum(sample.value for sample in errors.samples)
        # Adapters that only bump the plain total still show up.
        errors.add_metric(["unknown", "unlabelled"], c.protocol_errors - labelled)
        yield errors
        yield _by_key("skan_connections_refused",
                      "Connections refused at accept because max_connections "
                      "(broker-wide or the listener's) was reached.", "reason",
                      self.refused_keys, c.refused)
        # The plain ints of Counters declared with their metric (broker/core/tally.py).
        yield from _declared([(c, ())])

    def _security(self, router: Router) -> Iterator[Metric]:
        """Section 7: refused credentials and refused sends/subscriptions."""
        c = router.counters
        failures = CounterMetricFamily(
            "skan_auth_failures",
            "Connections refused for their credentials (wrong token, anonymous where not "
            "allowed, max_connections of the user, required client certificate missing).",
            labels=["protocol"])
        listeners = [p for p in self.protocols if not p.startswith("bridge-")]
        for proto in sorted({*listeners, *c.auth_failures}):
            failures.add_metric([proto], c.auth_failures.get(proto, 0))
        yield failures
        keys = [f"{p}:{a}" for p in self.protocols for a in ("publish", "subscribe")]
        yield _by_key(
            "skan_permission_denied",
            "Sends (publish) and subscriptions (subscribe) refused by the user's permissions.",
            "action", keys, c.permission_denied)

    def _traffic(self, router: Router, per: dict[str, dict[str, int]]) -> Iterator[Metric]:
        c = router.counters
        families = {
            "msgs_in": CounterMetricFamily("skan_messages_received",
                                           "Messages routed from senders on this protocol.",
                                           labels=["protocol"]),
            "bytes_in": CounterMetricFamily("skan_received_bytes",
                                            "Skan frame bytes routed from senders on this "
                                            "protocol.", labels=["protocol"]),
            "msgs_out": CounterMetricFamily("skan_messages_delivered",
                                            "Messages queued to recipients on this protocol.",
                                            labels=["protocol"]),
            "bytes_out": CounterMetricFamily("skan_delivered_bytes",
                                             "Bytes queued to recipients on this protocol "
                                             "(as encoded for that protocol).",
                                             labels=["protocol"]),
        }
        for proto, v in per.items():
            for key, family in families.items():
                family.add_metric([proto], v[key])
        yield from families.values()
        dropped = CounterMetricFamily("skan_messages_dropped", "Messages dropped, by reason.",
                                      labels=["protocol", "reason"])
        for proto, v in per.items():
            reason = "bridge-buffer-full" if proto.startswith("bridge-") else "queue-full"
            dropped.add_metric([proto, reason], v["dropped"])
        for key, n in sorted(c.drops.items()):
            dropped.add_metric(list(_split(key)), n)
        yield dropped

    def _queues(self, router: Router) -> Iterator[Metric]:
        total = dict.fromkeys(self.protocols, 0)
        largest = dict.fromkeys(self.protocols, 0)
        # One pass over every endpoint: keep it cheap (10,000 connections ~ 5 ms).
        for ep in list(router.endpoints.values()):
            if isinstance(ep, QueuedEndpoint):
                size = ep.queue.size
            elif isinstance(ep, BufferedBridgeEndpoint):  # bridge buffers hold Routed
                size = sum(len(r.frame) for r in ep.pending)
            else:
                continue
            proto = ep.protocol
            total[proto] = total.get(proto, 0) + size
            if size > largest.get(proto, 0):
                largest[proto] = size
        depth = GaugeMetricFamily("skan_outgoing_queue_bytes",
                                  "Bytes waiting in outgoing queues, summed per protocol.",
                                  labels=["protocol"])
        biggest = GaugeMetricFamily("skan_outgoing_queue_max_bytes",
                                    "The fullest single outgoing queue of each protocol.",
                                    labels=["protocol"])
        for proto in sorted(total):
            depth.add_metric([proto], total[proto])
            biggest.add_metric([proto], largest.get(proto, 0))
        yield depth
        yield biggest
        yield _gauge("skan_outgoing_queue_limit_bytes",
                     "Per-connection outgoing queue limit ([broker] queue_limit).",
                     self.ctx.config.broker.queue_limit)

    def _groups(self, router: Router) -> Iterator[Metric]:
        stats = router.group_stats
        if stats is None:
            return
        prune_group_stats(stats, self.allowed, self.top)
        msgs = CounterMetricFamily("skan_group_messages",
                                   "Messages routed on a group (allow-listed and top-N groups).",
                                   labels=["group"])
        deliveries = CounterMetricFamily("skan_group_deliveries",
                                         "Deliveries of messages of a group (allow-listed and "
                                         "top-N groups).", labels=["group"])
        subs = GaugeMetricFamily("skan_group_subscriptions",
                                 "Instance subscriptions on a group (allow-listed and top-N "
                                 "groups).", labels=["group"])
        for group in exported_groups(stats, self.allowed, self.top):
            counts = stats.get(group, (0, 0))
            label = [_label(group)]
            msgs.add_metric(label, counts[0])
            deliveries.add_metric(label, counts[1])
            subs.add_metric(label, router.group_subscriptions(group))
        yield msgs
        yield deliveries
        yield subs
        yield _gauge("skan_groups_tracked",
                     f"Groups with counts kept for per-group series (bounded by "
                     f"{GROUP_TRACK_LIMIT}).", len(stats))

    def _bridges(self, bridges: list[BridgeStatus], router: Router) -> Iterator[Metric]:
        if not bridges:
            return
        labels = ["bridge", "protocol"]
        up = GaugeMetricFamily("skan_bridge_up", "1 while the bridge is connected to its peer.",
                               labels=[*labels, "address"])
        buffered = GaugeMetricFamily("skan_bridge_buffered_messages",
                                     "Messages waiting in a bridge's buffer for its peer.",
                                     labels=labels)
        pending: dict[int, int] = {}
        for ep in list(router.endpoints.values()):
            if isinstance(ep, BufferedBridgeEndpoint):
                pending[id(ep.status)] = len(ep.pending)
        for status in bridges:
            ids = [status.name, status.protocol]
            up.add_metric([*ids, status.address], 1 if status.up else 0)
            buffered.add_metric(ids, pending.get(id(status), 0))
        yield up
        yield from _declared(((s, (s.name, s.protocol)) for s in bridges), labels)
        yield buffered

    def _routelog(self, log: RoutingLog | None) -> Iterator[Metric]:
        if log is None:
            return
        yield from _declared([(log.stats, ()), (log.recovery, ())])
        yield _gauge("skan_routelog_queued_records",
                     "Routing-log records waiting for the writer.", log.queued)
        yield _gauge("skan_routelog_lag_seconds",
                     "Age of the oldest routing-log record the writer has not taken yet.",
                     log.lag_seconds)
        yield _counter("skan_routelog_backpressure_waits",
                       "Times routing waited for the routing-log writer (disk slower than "
                       "traffic).", log.backpressure_waits)
        yield _gauge("skan_routelog_writer_failed",
                     "1 once the routing-log writer has stopped on an unexpected error.",
                     0 if log.failure is None else 1)

    def _cluster(self, ctx: BrokerContext) -> Iterator[Metric]:
        """The cluster view (section 8); every series exists, at 0, without a cluster."""
        link = ctx.cluster
        up = seen = 0
        # Without a cluster the classes stand in: their declared counters read 0.
        counted: list[object] = [BackplaneStats, Peers, ClusterLink]
        if link is not None:
            up = int(link.status.up)
            seen = len(link.brokers())
            counted = [link.backplane.stats, link.status.peers, link]
        yield _gauge("skan_cluster_up", "1 while the broker is connected to its NATS backplane.",
                     up)
        yield _gauge("skan_cluster_brokers_seen",
                     "Brokers of the cluster heard from within three heartbeats, this one "
                     "included (0 without a cluster).", seen)
        yield from _declared((obj, ()) for obj in counted)


def _keys(protocols: Iterable[str], reasons: Iterable[str]) -> tuple[str, ...]:
    """ "protocol:reason" for every pair."""
    return tuple(f"{p}:{r}" for p in protocols for r in reasons)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _declared(sources: Iterable[tuple[object, Sequence[str]]],
              labels: Sequence[str] = ()) -> Iterator[Metric]:
    """The families of the counters declared with broker.core.tally in each
    source (an object, or a class for zeros, with its values of ``labels``),
    in the order first declared; fields feeding one series add up."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    series: dict[str, dict[tuple[str, ...], float]] = {}
    for obj, ids in sources:
        for sample in described(obj):
            family = sample.family
            if family.name not in families:
                kind = CounterMetricFamily if family.kind == COUNTER else GaugeMetricFamily
                families[family.name] = kind(family.name, family.doc,
                                             labels=[*labels, *family.labels])
                series[family.name] = {}
            key = (*ids, *sample.labels)
            values = series[family.name]
            values[key] = values.get(key, 0) + sample.value
    for name, metric in families.items():
        for key, value in series[name].items():
            metric.add_metric(list(key), value)
        yield metric


def _by_key(name: str, doc: str, label: str, known: Iterable[str],
            counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter of "protocol:<label>" keys (Counters' dicts), sorted: every
    known key, 0 until counted, so its series exists from the start, and
    every key counted."""
    family = CounterMetricFamily(name, doc, labels=["protocol", label])
    for key, n in sorted({**dict.fromkeys(known, 0), **counts}.items()):
        family.add_metric(list(_split(key)), n)
    return family


def build_registry(ctx: BrokerContext, protocols: Iterable[str] = ("skan",),
                   errors: Mapping[str, Iterable[str]] | None = None) -> CollectorRegistry:
    """A private registry: the broker's collector plus process, platform and GC metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(ctx, protocols, errors))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def _store(retention: object) -> Iterator[Metric]:
    """The durable store's writer (broker/store): absent when the store is disabled."""
    if not isinstance(retention, Store):
        return
    yield _gauge("skan_store_bytes", "Frame bytes of the retained messages on disk.",
                 retention.bytes)
    yield _gauge("skan_store_pending", "Operations queued for the store's writer thread.",
                 retention.pending())
    yield from _declared([(retention.stats, ())])
