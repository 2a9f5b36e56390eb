"""SIGHUP: re-read the configuration and apply what can change while running (section 7).

Users, permissions, tokens, anonymous access, TLS certificates and CAs take
effect at once: connections whose credential no longer authenticates are
closed, subscriptions no longer permitted are removed.  Limits (per-user and
per-listener ``max_connections``, ``[broker]`` limits) apply to connections
accepted from then on.  A file that does not validate is refused with its key
and reason in the log, and the running configuration stays.  Host, port,
server id, scheduler hints, listener, bridge, log, retention and store changes
need a restart; the log says so.
"""

from __future__ import annotations

import logging

from broker.serving.config import (
    AUTH_LISTENERS,
    Config,
    ConfigError,
    build_authenticator,
    check_exposure,
)
from broker.serving.context import BrokerContext
from broker.serving.fdlimit import apply_descriptor_limit
from broker.serving.tls import server_ssl_context

log = logging.getLogger(__name__)

# Close reason of connections whose credential a reload revoked.
REVOKED = "revoked"


def _restart_needed(old: Config, new: Config) -> list[str]:
    keys = []
    # The scheduler hints are applied by the threads themselves as they start;
    # the host loop is the main thread's, chosen before trio starts.
    for key in ("host", "server_id", "routing_slice", "writer_nice", "writer_idle",
                "host_loop"):
        if getattr(old.broker, key) != getattr(new.broker, key):
            keys.append(f"broker.{key}")
    for section in ("log", "retention", "store", "cluster"):
        if getattr(old, section) != getattr(new, section):
            keys.append(f"[{section}]")
    for name in (*AUTH_LISTENERS, "metrics"):
        o, n = getattr(old, name), getattr(new, name)
        if o.port != n.port:
            keys.append(f"{name}.port")
        if getattr(o, "enabled", True) != getattr(n, "enabled", True):
            keys.append(f"{name}.enabled")
        if (o.tls_cert is None) != (n.tls_cert is None):
            keys.append(f"{name}.tls_cert (turning TLS on or off)")
    if old.bridges != new.bridges:
        keys.append("bridges")
    return keys


def reload_config(ctx: BrokerContext) -> bool:
    """Re-read and apply the configuration; False (and the old one stays) when refused."""
    if ctx.reload is None:
        log.warning("reload requested, but this broker was started without a config file")
        return False
    try:
        new = ctx.reload()
        check_exposure(new)
        auth = build_authenticator(new)
        contexts = {
            name: server_ssl_context(section.tls_cert, section.tls_key, section.tls_ca,
                                     section.tls_client_auth)
            for name in AUTH_LISTENERS
            if (section := getattr(new, name)).tls_cert and section.tls_key
        }
    except ConfigError as exc:
        log.error("reload refused, the running configuration stays: %s", exc)
        return False
    except (OSError, ValueError) as exc:  # unreadable certificate, key or CA
        log.error("reload refused, the running configuration stays: TLS: %s", exc)
        return False
    new = apply_descriptor_limit(new)
    ctx.limits.broker_max = new.broker.max_connections
    old = ctx.config
    for key in _restart_needed(old, new):
        log.warning("reload: %s changed; that takes effect only after a restart", key)
    for name, listeners in ctx.tls_listeners.items():
        if name in contexts:
            for listener in listeners:
                listener.context = contexts[name]
    revoked = ctx.router.reload_auth(auth)
    for ep in revoked:
        log.info("reload: closing %s %s: its credential no longer authenticates",
                 ep.protocol, ep.lname.decode())
        kill = getattr(ep, "kill", None)
        if kill is not None:
            kill(REVOKED)
        else:
            ctx.router.detach(ep, REVOKED)
    ctx.config = new
    log.info("configuration reloaded: %d users, %d connections closed",
             len(new.users), len(revoked))
    return True
