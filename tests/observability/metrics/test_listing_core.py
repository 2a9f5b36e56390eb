"""The listing's own rules against a router in memory: sorting in slices, the
snapshot's reuse and expiry, the bounds on subscription walks, query parsing."""

from __future__ import annotations

import json
import random

import pytest
import trio
import trio.testing

from broker.core.queue import QueuedEndpoint
from broker.core.router import NORMAL, PROMISC, Router
from broker.observability import listing as lst
from broker.observability.listing import BadQuery, Listing, sliced_sort


def endpoints(router: Router, n: int) -> list[QueuedEndpoint]:
    out = []
    for i in range(n):
        ep = QueuedEndpoint(router, 16 << 20, "disconnect")
        ep.remote = f"10.0.0.{i % 250}:{40000 + i}"
        router.attach(ep)
        out.append(ep)
    return out


@pytest.mark.parametrize("n", [0, 1, 1999, 2000, 2001, 9999])
@pytest.mark.parametrize("reverse", [False, True])
async def test_sliced_sort_is_sorted_and_stable(n, reverse):
    rng = random.Random(n)
    rows = [(rng.randrange(50), i) for i in range(n)]
    key = lambda r: r[0]  # noqa: E731 - ties keep their order, as sorted() does
    assert await sliced_sort(rows, key, reverse) == sorted(rows, key=key, reverse=reverse)


async def test_connections_sort_filter_and_page():
    router = Router()
    eps = endpoints(router, 30)
    for i, ep in enumerate(eps):
        ep.msgs_out = (i * 7) % 11
        ep.queue.push(b"x" * (i % 5))
    router.subscribe(eps[3], b"alarms", b"*", NORMAL)
    router.subscribe_pattern(eps[4], (b"alarms", b"*"), NORMAL)
    router.subscribe_pattern(eps[5], (b"*",), NORMAL)
    router.subscribe(eps[6], b"other", b"*", PROMISC)
    listing = Listing(router)
    data = json.loads(await listing.connections_json("/connections?sort=msgs_out&limit=100"))
    got = [(r["msgs_out"], r["lname"]) for r in data["connections"]]
    # Largest first, ties in lname order.
    assert got == sorted(got, key=lambda t: (-t[0], t[1]))
    data = json.loads(await listing.connections_json("/connections?sort=queue&order=asc"))
    sizes = [r["queue_bytes"] for r in data["connections"]]
    assert sizes == sorted(sizes) and data["order"] == "asc"
    data = json.loads(await listing.connections_json("/connections?group=alarms"))
    assert {r["lname"] for r in data["connections"]} == {
        eps[i].lname.decode() for i in (3, 4, 5)}
    page = json.loads(await listing.connections_json("/connections?offset=28&limit=5"))
    assert page["total"] == 30 and len(page["connections"]) == 2
    assert [r["remote"] for r in page["connections"]] == [eps[28].remote, eps[29].remote]


async def test_snapshot_is_reused_then_refreshed(autojump_clock):
    router = Router()
    endpoints(router, 3)
    listing = Listing(router)
    first = json.loads(await listing.connections_json("/connections"))
    endpoints(router, 2)
    again = json.loads(await listing.connections_json("/connections"))
    assert again["total"] == first["total"] == 3 and listing.connections.walks == 1
    await trio.sleep(lst.SNAPSHOT_TTL)
    fresh = json.loads(await listing.connections_json("/connections"))
    assert fresh["total"] == 5 and listing.connections.walks == 2


async def test_concurrent_requests_share_one_walk():
    router = Router()
    endpoints(router, 3 * lst.SCAN_SLICE)  # the walk checkpoints: requests overlap it
    listing = Listing(router)
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(listing.connections_json, "/connections")
    assert listing.connections.walks == 1


async def test_subscription_walk_is_bounded(monkeypatch):
    monkeypatch.setattr(lst, "MAX_SUBSCRIPTION_ROWS", 50)
    monkeypatch.setattr(lst, "SCAN_SLICE", 10)
    router = Router()
    for i, ep in enumerate(endpoints(router, 80)):
        router.subscribe(ep, f"g{i % 3}".encode(), b"*", NORMAL)
    listing = Listing(router)
    data = json.loads(await listing.subscriptions_json("/subscriptions?limit=1000"))
    assert data["truncated"] and data["total"] == 50 and data["subscriptions_total"] == 80
    # A group's own index is walked, not everything.
    data = json.loads(await listing.subscriptions_json("/subscriptions?group=g1"))
    assert not data["truncated"] and data["total"] == 27
    assert {s["group"] for s in data["subscriptions"]} == {"g1"}


@pytest.mark.parametrize("restarts", [0, 2])
async def test_subscription_walk_restarts_when_the_index_changes(monkeypatch, restarts):
    monkeypatch.setattr(lst, "SCAN_SLICE", 10)
    monkeypatch.setattr(lst, "MAX_RESTARTS", restarts)
    router = Router()
    eps = endpoints(router, 40)
    for ep in eps:
        router.subscribe(ep, b"g", b"*", NORMAL)
    listing = Listing(router)
    extra = endpoints(router, 1)[0]

    async def churn():
        await trio.lowlevel.checkpoint()
        router.subscribe(extra, b"g", b"*", NORMAL)  # while the walk is between slices

    async with trio.open_nursery() as nursery:
        nursery.start_soon(churn)
        data = json.loads(await listing.subscriptions_json("/subscriptions?limit=1000"))
    if restarts:
        # The walk started over and saw the new subscription: whole, not torn.
        assert data["total"] == 41 and not data["truncated"]
    else:
        # No restart allowed: what was read, said to be partial.
        assert data["truncated"] and data["total"] < 41


@pytest.mark.parametrize(("target", "why"), [
    ("/connections?limit=1001", "at most 1000"),
    ("/connections?limit=x", "non-negative integer"),
    ("/connections?sort=colour", "must be one of"),
    ("/connections?protocol=a&protocol=b", "given 2 times"),
    ("/connections?subs=maybe", "1 or 0"),
    ("/subscriptions?subs=1", "unknown parameter"),
])
async def test_bad_queries(target, why):
    listing = Listing(Router())
    call = listing.connections_json if target.startswith("/connections") else \
        listing.subscriptions_json
    with pytest.raises(BadQuery, match=why):
        await call(target)


async def test_a_gone_connection_is_shown_without_its_list():
    router = Router()
    eps = endpoints(router, 2)
    listing = Listing(router)
    await listing.connections_json("/connections")  # snapshot with both
    router.detach(eps[0])
    data = json.loads(await listing.connections_json("/connections?subs=1"))
    rows = {r["lname"]: r for r in data["connections"]}
    assert rows[eps[0].lname.decode()]["subscription_list"] is None
    assert rows[eps[1].lname.decode()]["subscription_list"] == []
