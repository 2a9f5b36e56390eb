"""The services a broker runs, in start order.

Each entry is ``(name, enabled(config), serve)`` where ``serve(ctx,
task_status=...)`` reports ``[(protocol, host, port), ...]`` through
``task_status.started`` once it is listening (an empty list for services
without a port, like bridges).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.app.configured_bridges import serve_bridges
from broker.cluster.cluster_service import serve_cluster
from broker.observability.http import serve_metrics
from broker.observability.routelog.routelog_service import serve_routelog
from broker.protocols.eventer.listener import serve_eventer
from broker.protocols.hsp.listener import serve_hsp
from broker.protocols.mariner.listener import serve_mariner
from broker.protocols.skan.listener import serve_skan
from broker.serving.config import Config
from broker.store.store_service import serve_store

Service = tuple[str, Callable[[Config], bool], Callable[..., Any]]


def services() -> list[Service]:
    return [
        # First: the log observes every message from the first one routed.
        ("routelog", lambda c: c.log.enabled, serve_routelog),
        # Before anything routes: retention (durable or in memory) and the
        # session numbering continued from the store.
        ("store", lambda c: True, serve_store),
        # Before the listeners: a duplicate server id must stop the start-up.
        ("cluster", lambda c: c.cluster.enabled, serve_cluster),
        ("skan", lambda c: True, serve_skan),
        ("hsp", lambda c: c.hsp.enabled, serve_hsp),
        ("eventer", lambda c: c.eventer.enabled, serve_eventer),
        ("mariner", lambda c: c.mariner.enabled, serve_mariner),
        ("metrics", lambda c: c.metrics.enabled, serve_metrics),
        # Last: bridges dial out once every listener is up.
        ("bridges", lambda c: bool(c.bridges), serve_bridges),
    ]
