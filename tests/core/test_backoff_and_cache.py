"""The one backoff rule and the one bounded-cache rule (broker/core/backoff.py, bounded.py)."""

from __future__ import annotations

import pytest

from broker.core.backoff import JITTER, Backoff
from broker.core.bounded import BoundedCache


def test_backoff_doubles_to_the_cap_and_resets():
    b = Backoff(0.5, 3.0, rand=lambda: 0.5)  # the middle of the jitter band: no jitter
    assert [b.wait() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.wait() == 0.5


@pytest.mark.parametrize("r", [0.0, 0.999999])
def test_backoff_jitter_stays_in_its_band(r):
    b = Backoff(10.0, 10.0, rand=lambda: r)
    assert 10.0 * (1 - JITTER) - 1e-9 <= b.wait() <= 10.0 * (1 + JITTER)


def test_bounded_cache_clears_when_full_with_its_companions():
    index: dict = {"k": 1}
    allowed: set = {"x"}
    cache: BoundedCache[str, int] = BoundedCache(3, also=(index, allowed))
    for i in range(3):
        assert cache.put(f"k{i}", i) == i
    assert len(cache) == 3 and index and allowed
    cache.put("k3", 3)  # full: everything goes, then the new entry
    assert dict(cache) == {"k3": 3}
    assert index == {} and allowed == set()
    assert cache.get("k3") == 3 and "k0" not in cache
