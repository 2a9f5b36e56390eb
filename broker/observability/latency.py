"""Routing-latency buckets filled per received chunk, exported as a histogram at scrape time.

The transport times one received chunk (decode, route, queue every
delivery, end the batch) with a single ``perf_counter`` pair and calls
:meth:`RouteLatency.observe` with the elapsed time and how many messages the
chunk routed.  No Prometheus call happens on this path: ``labels().inc()``
costs about as much as routing a whole message.

Messages of one chunk are queued one after another, so with equal cost per
message the i-th of n was queued ``i/n`` of the chunk's time after the
chunk arrived; ``observe`` spreads the n messages over the buckets that way
(an exact per-message figure would need a clock read per message).
"""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds in seconds.  A single message routes in a few microseconds;
# a full 256 KiB chunk of small messages takes a few milliseconds; anything
# past 100 ms means the event loop was starved.
BOUNDS: tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)


class RouteLatency:
    """Plain per-bucket counts (not cumulative); the last slot is +Inf."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float, n: int) -> None:
        """Record ``n`` messages routed from one chunk that took ``seconds``."""
        if n <= 0:
            return
        counts = self.counts
        self.count += n
        if n == 1 or seconds <= 0.0:
            counts[bisect_left(BOUNDS, seconds)] += n
            self.sum += seconds * n
            return
        # Messages with latency <= b: floor(n * b / seconds), capped at n.
        below = 0
        for i, bound in enumerate(BOUNDS):
            if bound >= seconds:
                counts[i] += n - below
                break
            upto = int(n * bound / seconds)
            counts[i] += upto - below
            below = upto
        else:
            counts[-1] += n - below
        self.sum += seconds * (n + 1) / 2

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, +Inf last, as a Prometheus histogram wants."""
        out = []
        total = 0
        for bound, c in zip((*BOUNDS, float("inf")), self.counts, strict=True):
            total += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out
