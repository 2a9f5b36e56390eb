"""Descriptors at start-up (BROKER-SPEC section 9): raise RLIMIT_NOFILE, fit max_connections.

Every client connection holds one descriptor.  At start the broker raises
its soft ``RLIMIT_NOFILE`` to the hard limit (the most an unprivileged
process may have); if even that cannot hold ``[broker] max_connections``
plus what the broker needs besides its clients, ``max_connections`` is
lowered, with a warning, so clients are refused with their protocol's
"too many connections" before descriptors run out, and the metrics
endpoint, the routing log and bridges always have theirs.
"""

from __future__ import annotations

import logging
import resource

import attrs

from broker.serving.config import Config

log = logging.getLogger(__name__)

# Descriptors kept out of max_connections for everything that is not a
# client connection: listening sockets (up to two per port with dual-stack
# hosts, five ports), the metrics endpoint's connections (at most 32),
# routing-log and store files, the trio wake-up pipe and epoll, stdio, and a
# margin for TLS and DNS look-ups by bridges.  Bridges add one each on top.
FD_RESERVE = 100


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        # An unlimited hard limit can exceed what the kernel allows (nr_open).
        log.info("could not raise the descriptor limit from %d to %s: %s", soft, hard, exc)
        return soft
    if soft != hard:
        log.info("descriptor limit raised from %d to %d", soft, hard)
    return hard


def fit_max_connections(config: Config, nofile: int) -> Config:
    """``config`` with ``[broker] max_connections`` lowered to what ``nofile`` descriptors hold."""
    if nofile == resource.RLIM_INFINITY:
        return config
    room = max(1, nofile - FD_RESERVE - len(config.bridges))
    wanted = config.broker.max_connections
    if wanted <= room:
        return config
    log.warning(
        "[broker] max_connections = %d does not fit the descriptor limit of %d (minus %d "
        "for listeners, metrics, files and bridges): lowered to %d; raise the hard limit "
        "(ulimit -Hn, LimitNOFILE= in systemd) to allow more",
        wanted, nofile, nofile - room, room,
    )
    return attrs.evolve(config, broker=attrs.evolve(config.broker, max_connections=room))


def apply_descriptor_limit(config: Config) -> Config:
    """What the broker does at start: raise the limit, then fit max_connections to it."""
    return fit_max_connections(config, raise_nofile_limit())
