"""The other brokers of the cluster, as heartbeats and pings show them (pure).

Heartbeats (``skc.hb.<server>``, JSON ``{"server": N, "boot": "hex"}``) are
untrusted input like every byte from NATS: decoded with a bound
(:func:`decode_hello`, a :class:`wire.errors.MalformedError` for anything
else), the server id must be the one the subject names, and at most
:data:`MAX_PEERS` other brokers are tracked (the rest are counted in
``refused`` and ignored).  A heartbeat only makes a broker *heard*: it
counts in ``brokers_seen``, and a cluster query waits for it, only once it
has *proved* alive by answering a ping (``skc.ping.<this server>``, sent
when a broker is first heard or restarts, and again after it missed a
query) in its current boot.  So forged heartbeats can neither inflate
``brokers_seen`` nor make queries wait for brokers that never answer.

The boot id (random, per broker process) tells a restart apart from a
broker that goes on: on a new boot the broker's dedupe window and interest
are reset (:meth:`Backplane.peer_restarted`).
"""

from __future__ import annotations

import json
import secrets

import attrs

from broker.cluster.interest import MAX_PEERS
from broker.core.tally import counter
from wire.errors import MalformedError

# Bytes of a heartbeat or ping answer at most (it is about 50).
MAX_HELLO = 512
# Hex digits of a boot id.
BOOT_DIGITS = 16
INT64_LIMIT = 2**63


def new_boot() -> str:
    return secrets.token_hex(BOOT_DIGITS // 2)


def encode_hello(server_id: int, boot: str) -> bytes:
    """A heartbeat's payload (and a ping's answer)."""
    return json.dumps({"server": server_id, "boot": boot}).encode()


def decode_hello(payload: bytes) -> tuple[int, str]:
    """(server id, boot id) of a heartbeat or a ping answer; MalformedError for
    anything else (an infinite, fractional or huge server, a boolean ...)."""
    if len(payload) > MAX_HELLO:
        raise MalformedError(f"heartbeat of {len(payload)} bytes (at most {MAX_HELLO})")
    try:
        fields = json.loads(payload)
    except (ValueError, RecursionError):
        raise MalformedError("heartbeat is not JSON") from None
    if not isinstance(fields, dict):
        raise MalformedError("heartbeat is not a JSON object")
    server, boot = fields.get("server"), fields.get("boot")
    if type(server) is not int or not 0 <= server < INT64_LIMIT:
        raise MalformedError("heartbeat without a server id in range")
    if (type(boot) is not str or len(boot) != BOOT_DIGITS
            or not all(c in "0123456789abcdef" for c in boot)):
        raise MalformedError("heartbeat without a boot id")
    return server, boot


# What Peers.heard says about a heartbeat.
NEW, RESTARTED, KNOWN, REFUSED = "new", "restarted", "known", "refused"


@attrs.define(eq=False)
class Peers:
    """Other brokers heard, their boot ids, and those that proved alive."""

    server_id: int
    max_peers: int = MAX_PEERS
    # server id -> trio time of its last heartbeat
    seen: dict[int, float] = attrs.Factory(dict)
    boots: dict[int, str] = attrs.Factory(dict)
    # server id -> the boot in which it answered a ping (kept when a broker
    # is forgotten for a late heartbeat: the same boot heard again needs no
    # new ping; at most max_peers entries).
    proven: dict[int, str] = attrs.Factory(dict)
    # Heartbeats refused: over max_peers.
    refused: int = counter("skan_cluster_peers_refused",
                           "Heartbeats of brokers beyond the bound on peers, ignored.")

    def heard(self, server: int, boot: str, now: float, expire: float) -> str:
        """A heartbeat of ``server`` (already checked against its subject)."""
        if server == self.server_id:
            return KNOWN
        old = self.boots.get(server)
        if old is None:
            if len(self.seen) >= self.max_peers:
                self.forget(now, expire)
                if len(self.seen) >= self.max_peers:
                    self.refused += 1
                    return REFUSED
            self.seen[server] = now
            self.boots[server] = boot
            return NEW
        self.seen[server] = now
        if old != boot:
            self.boots[server] = boot
            self.proven.pop(server, None)
            return RESTARTED
        return KNOWN

    def is_proven(self, server: int) -> bool:
        boot = self.boots.get(server)
        return boot is not None and self.proven.get(server) == boot

    def proved(self, server: int, boot: str) -> bool:
        """A ping answer: ``server`` is alive in boot ``boot``."""
        if self.boots.get(server) != boot:
            return False
        if server not in self.proven and len(self.proven) >= self.max_peers:
            self.proven = {s: b for s, b in self.proven.items() if s in self.boots}
        self.proven[server] = boot
        return True

    def missed(self, servers: set[int]) -> None:
        """These brokers did not answer a query in time: ping before waiting again."""
        for server in servers:
            self.proven.pop(server, None)

    def forget(self, now: float, expire: float) -> None:
        """Drop brokers not heard for ``expire`` seconds."""
        for server, when in list(self.seen.items()):
            if now - when >= expire:
                del self.seen[server]
                if server not in self.proven:
                    self.boots.pop(server, None)

    def alive(self, now: float, expire: float) -> list[int]:
        """Other brokers heard within ``expire`` that proved alive."""
        return [s for s, t in self.seen.items() if now - t < expire and self.is_proven(s)]
