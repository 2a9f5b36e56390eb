"""Routing-latency buckets: one observation per chunk, spread over its messages."""

from __future__ import annotations

from broker.observability.latency import BOUNDS, RouteLatency


def _cum(lat: RouteLatency) -> dict[str, int]:
    return dict(lat.cumulative())


def test_single_message_lands_in_its_bucket():
    lat = RouteLatency()
    lat.observe(7e-6, 1)
    cum = _cum(lat)
    assert cum["5e-06"] == 0 and cum["1e-05"] == 1 and cum["+Inf"] == 1
    assert lat.count == 1 and lat.sum == 7e-6


def test_chunk_spreads_messages_evenly():
    lat = RouteLatency()
    # 100 messages routed in 1 ms: the i-th is queued at i * 10 us.
    lat.observe(1e-3, 100)
    cum = _cum(lat)
    assert cum["5e-06"] == 0
    assert cum["1e-05"] == 1
    assert cum["2.5e-05"] == 2
    assert cum["0.0001"] == 10
    assert cum["0.0005"] == 50
    assert cum["0.001"] == 100 and cum["+Inf"] == 100
    assert lat.count == 100
    assert abs(lat.sum - 1e-3 * 101 / 2) < 1e-12


def test_slower_than_every_bound_goes_to_inf_and_zero_is_ignored():
    lat = RouteLatency()
    lat.observe(2.0, 4)
    lat.observe(0.5, 0)
    cum = _cum(lat)
    assert cum[repr(BOUNDS[-1])] == 2  # half of them within 1 s
    assert cum["+Inf"] == 4 and lat.count == 4


def test_cumulative_is_monotonic_and_complete():
    lat = RouteLatency()
    for seconds, n in ((3e-6, 1), (4e-4, 7), (0.02, 300), (0.0, 2)):
        lat.observe(seconds, n)
    values = [c for _, c in lat.cumulative()]
    assert values == sorted(values)
    assert values[-1] == lat.count == 310
    assert len(values) == len(BOUNDS) + 1
