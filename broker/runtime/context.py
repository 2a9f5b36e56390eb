"""What every service of a running broker shares."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from broker.core.router import Router
from broker.runtime.config import Config
from broker.runtime.transport import Connections


@attrs.define(eq=False)
class BrokerContext:
    config: Config
    router: Router
    connections: Connections = attrs.Factory(Connections)
    # Connection handlers of every listener run here, outside the accept
    # loops, so a graceful stop can close the listeners first and then drain.
    conn_nursery: trio.Nursery | None = None
    # Sync hooks run when a graceful stop begins (e.g. Eventer 'stopping').
    on_stopping: list[Callable[[], None]] = attrs.Factory(list)
    # Async hooks run after connections have drained (e.g. flush the routing log).
    on_stopped: list[Callable[[], Awaitable[None]]] = attrs.Factory(list)
    # Bridge status objects, one per [[bridges]] entry (metrics export them).
    bridges: list[Any] = attrs.Factory(list)
    # Optional components other services look up by name (retention store, log writer, ...).
    components: dict[str, Any] = attrs.Factory(dict)
    # TLS listeners per listener section, whose contexts a reload replaces.
    tls_listeners: dict[str, list[Any]] = attrs.Factory(dict)
    # Re-reads the configuration (file plus flags) on SIGHUP; None: no reload.
    reload: Callable[[], Config] | None = None

    async def open_listeners(self, name: str) -> list[trio.abc.Listener]:
        """Open the listeners of config section ``name`` (port, TLS, client
        certificates) and remember its TLS listeners for a reload."""
        from broker.runtime.transport import TLSListener, open_listeners

        section = getattr(self.config, name)
        listeners = await open_listeners(
            self.config.broker.host, section.port, section.tls_cert, section.tls_key,
            tls_ca=section.tls_ca, client_auth=section.tls_client_auth,
        )
        self.tls_listeners[name] = [lst for lst in listeners if isinstance(lst, TLSListener)]
        return listeners

    async def serve(self, listeners: list[trio.abc.Listener], handle) -> None:
        """Accept on ``listeners``; each connection runs in the shared connection nursery."""
        from broker.runtime.transport import make_handler

        assert self.conn_nursery is not None
        await trio.serve_listeners(
            make_handler(handle), listeners, handler_nursery=self.conn_nursery
        )
