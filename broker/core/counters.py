"""Broker-wide counters: plain ints on the per-message path, read by ``stats`` and metrics."""

from __future__ import annotations

import attrs

from broker.core.tally import counter


@attrs.define
class Counters:
    """Broker-wide counters.  Plain ints: they are on the per-message path."""

    msgs_in: int = 0
    bytes_in: int = 0
    msgs_out: int = 0
    bytes_out: int = 0
    undeliverable: int = counter("skan_messages_undeliverable", "Messages routed to no recipient.")
    dropped: int = 0
    slow_consumer_disconnects: int = counter(
        "skan_slow_consumer_disconnects",
        "Connections closed because their outgoing queue was full (slow_consumer = disconnect).")
    protocol_errors: int = 0
    # Subscribes refused by max_subscriptions (also counted as protocol errors
    # by the adapter that answered them).
    subscriptions_refused: int = 0
    accepted: dict[str, int] = attrs.Factory(dict)
    closed: dict[str, int] = attrs.Factory(dict)
    # Totals of endpoints that have gone, so per-protocol sums survive disconnects.
    gone_in: dict[str, list[int]] = attrs.Factory(dict)
    gone_out: dict[str, list[int]] = attrs.Factory(dict)
    # "protocol:reason" -> count; see protocol_error() and drop().
    errors: dict[str, int] = attrs.Factory(dict)
    drops: dict[str, int] = attrs.Factory(dict)
    # "protocol:reason" -> connections refused at accept (max_connections).
    refused: dict[str, int] = attrs.Factory(dict)
    # accept() calls that failed for lack of descriptors or memory (EMFILE, ...).
    accept_errors: int = counter(
        "skan_accept_errors",
        "accept() calls that failed for lack of descriptors or memory (EMFILE, ENFILE, ...); "
        "the listener retries.")
    # Section 7: protocol -> refused credentials; "protocol:action" -> refusals.
    auth_failures: dict[str, int] = attrs.Factory(dict)
    permission_denied: dict[str, int] = attrs.Factory(dict)

    def auth_failure(self, protocol: str) -> None:
        self.auth_failures[protocol] = self.auth_failures.get(protocol, 0) + 1

    def denied(self, protocol: str, action: str) -> None:
        key = f"{protocol}:{action}"
        self.permission_denied[key] = self.permission_denied.get(key, 0) + 1

    def protocol_error(self, protocol: str, reason: str) -> None:
        """Count one protocol error.  ``reason`` is a short fixed label
        ("malformed", "rejected", ...), never free text: it becomes a metric label."""
        self.protocol_errors += 1
        key = f"{protocol}:{reason}"
        self.errors[key] = self.errors.get(key, 0) + 1

    def refuse(self, protocol: str, reason: str) -> None:
        """Count one connection refused at accept (a RefusalReason label)."""
        key = f"{protocol}:{reason}"
        self.refused[key] = self.refused.get(key, 0) + 1

    def drop(self, protocol: str, reason: str) -> None:
        """Count one message dropped for a reason other than a full outgoing queue
        (which endpoints count themselves), e.g. an HSP DATA of an unknown Type."""
        self.dropped += 1
        key = f"{protocol}:{reason}"
        self.drops[key] = self.drops.get(key, 0) + 1

    def endpoint_gone(self, protocol: str, reason: str, msgs_in: int, bytes_in: int,
                      msgs_out: int, bytes_out: int, dropped: int) -> None:
        """Count a closed connection and keep its totals, so per-protocol sums survive it."""
        key = f"{protocol}:{reason}"
        self.closed[key] = self.closed.get(key, 0) + 1
        gin = self.gone_in.setdefault(protocol, [0, 0])
        gin[0] += msgs_in
        gin[1] += bytes_in
        gout = self.gone_out.setdefault(protocol, [0, 0, 0])
        gout[0] += msgs_out
        gout[1] += bytes_out
        gout[2] += dropped
