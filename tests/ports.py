"""A free TCP port for a listener a test starts *after* something dials it.

A port the kernel hands out for ``bind(port 0)`` lies in the ephemeral range
(``net.ipv4.ip_local_port_range``), the same range outgoing connections take
their local port from.  A broker bridge that keeps dialling 127.0.0.1:P while
nothing listens there can then be given P as its own local port: Linux
connects the socket to itself (TCP simultaneous open), and the listener the
test starts later fails with "address already in use".  A port below the
ephemeral range is never a connection's local port.
"""

from __future__ import annotations

import random
import socket

_FALLBACK_RANGE = (32768, 60999)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_RANGE[0]


def listener_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range that is free to bind now."""
    high = min(_ephemeral_low(), 65536) - 1
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")
