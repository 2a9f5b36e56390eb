"""What every service of a running broker shares: one typed context object."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from broker.core.router import Router
from broker.serving.config import Config
from broker.serving.connections import ConnectionLimits, Connections
from broker.serving.scheduling import StallWatch
from broker.serving.tls import TLSListener

if TYPE_CHECKING:
    from broker.cluster.cluster_query import LocalQuery
    from broker.cluster.link import ClusterLink
    from broker.core.retention import RetentionStore
    from broker.observability.routelog.writer import RoutingLog
    from broker.serving.bridge_runner import BridgeStatus
    from broker.store import Store
    from broker.store.retained_query import LatestTable


@attrs.define(eq=False)
class BrokerContext:
    config: Config
    router: Router
    connections: Connections = attrs.Factory(Connections)
    # Live client connections against [broker] max_connections and each
    # listener's own (see broker.serving.transport.serve_protocol).
    limits: ConnectionLimits = attrs.Factory(
        lambda self: ConnectionLimits(self.config.broker.max_connections), takes_self=True
    )
    # Names of the services this broker runs (see broker.app.services),
    # known before any starts, so e.g. metrics know which listeners exist.
    services: tuple[str, ...] = ()
    # Connection handlers of every listener run here, outside the accept
    # loops, so a graceful stop can close the listeners first and then drain.
    conn_nursery: trio.Nursery | None = None
    # Sync hooks run when a graceful stop begins (e.g. Eventer 'stopping').
    on_stopping: list[Callable[[], None]] = attrs.Factory(list)
    # Tasks started once the broker printed its listening lines: start-up
    # work that must not delay it (e.g. compiling the Chatter schemas).
    after_start: list[Callable[[], Awaitable[None]]] = attrs.Factory(list)
    # Async hooks run after connections have drained (e.g. flush the routing log).
    on_stopped: list[Callable[[], Awaitable[None]]] = attrs.Factory(list)
    # Bridge status objects, one per [[bridges]] entry (metrics export them).
    bridges: list[BridgeStatus] = attrs.Factory(list)
    # Optional components, set by the service that owns them (None when off).
    # The durable store, or the in-memory ring with [store] enabled = false.
    retention: Store | RetentionStore | None = None
    routelog: RoutingLog | None = None
    # The Eventer service's query (with its latest table and the store's
    # flush), for cluster queries from other brokers.
    eventer_query: LocalQuery | None = None
    latest: LatestTable | None = None
    # TLS listeners per listener protocol, whose contexts a reload replaces.
    tls_listeners: dict[str, list[TLSListener]] = attrs.Factory(dict)
    # Re-reads the configuration (file plus flags) on SIGHUP; None: no reload.
    reload: Callable[[], Config] | None = None
    cluster: ClusterLink | None = None
    # The routing thread's lateness, watched once for every writer thread
    # that may go idle (the store's, the routing log's); run by the lifecycle.
    stall_watch: StallWatch = attrs.Factory(StallWatch)
