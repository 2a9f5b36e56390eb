"""``*`` may only end an event-type pattern: every pattern a peer (or the configuration) sends.

One rule (broker/core/eventtypes.py ``pattern_problem``), each protocol's
error: an Eventer init is refused (test_listener.py), an Eventer query is
answered empty and counted, a Mariner init gets ``error`` and is closed, a
bridge's subscriptions refuse to load.
"""

from __future__ import annotations

import pytest

from broker.core.eventtypes import (
    event_type,
    group_instance,
    matches,
    pattern_group,
    pattern_problem,
)
from broker.serving import config as cfgmod
from clients.skan import SkanClient
from tests.rawmariner import RawMariner
from toolkit.eventer_client import EventerClient
from wire.eventer import QueryLatestParams, QueryTimeseriesParams


@pytest.mark.parametrize("pattern", [("a", "*", "b"), ("*", "x"), (b"a", b"*", b"*")])
def test_a_middle_star_is_a_problem(pattern):
    assert "'*' may only be the last segment" in pattern_problem(pattern)


@pytest.mark.parametrize("pattern", [("a", "*"), ("*",), ("a", "?", "b"), (), (b"a", b"?")])
def test_a_last_star_is_not(pattern):
    assert pattern_problem(pattern) is None


def test_the_group_a_pattern_reaches():
    assert pattern_group((b"g", b"*")) == b"g"
    assert pattern_group(("g", "?")) == "g"
    assert pattern_group((b"*",)) is None
    assert pattern_group(("?", "x")) is None
    assert pattern_group(()) is None


def test_event_type_and_group_instance_are_inverse():
    for group, instance in [(b"g", b"*"), (b"g", b"a"), (b"g", b"a/b/c")]:
        etype = tuple(s.decode() for s in event_type(group, instance))
        assert group_instance(etype) == (group.decode(), instance.decode())
    assert matches((b"g", b"*"), event_type(b"g", b"a/b"))
    assert not matches((b"g", b"?"), event_type(b"g", b"a/b"))


async def test_eventer_query_with_a_middle_star_is_answered_empty_and_counted(broker):
    async with SkanClient.connect(*broker.skan) as pub:
        await pub.send("sl", "one", instance="x/y")
        await pub.getlname()
    async with EventerClient.connect(*broker.addr["eventer"], "star/test") as client:
        good = await client.query(QueryLatestParams((("sl", "*"),)))
        assert [e.type for e in good.events] == [("sl", "x", "y")]
        for params in (QueryLatestParams((("sl", "*", "y"),)),
                       QueryTimeseriesParams(event_types=(("sl", "*", "y"),))):
            bad = await client.query(params)
            assert list(bad.events) == []
            assert not bad.more_follows
    async with SkanClient.connect(*broker.skan) as c:
        stats = await c.stats()
    assert int(stats["protocol_errors"]) >= 2


async def test_mariner_init_with_a_middle_star_is_closed_with_error(broker):
    raw = await RawMariner.open(broker.addr["mariner"])
    await raw.init(subscriptions=[["sl", "*", "b"]])
    [error] = await raw.expect_closed()
    assert error["type"] == "error"
    assert "'*' may only be the last segment" in error["error"]


@pytest.mark.parametrize("protocol", ["eventer", "mariner"])
def test_bridge_subscriptions_with_a_middle_star_do_not_load(protocol):
    bridge = {"protocol": protocol, "address": "127.0.0.1:1", "group": "g",
              "subscriptions": [["g", "*", "x"]]}
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.from_mapping({"bridges": [bridge]})
    assert "bridges[0].subscriptions" in str(info.value)
    assert "'*' may only be the last segment" in str(info.value)


def test_a_bridge_with_a_last_star_loads():
    bridge = {"protocol": "mariner", "address": "127.0.0.1:1", "group": "g",
              "subscriptions": [["g", "*"]]}
    assert cfgmod.from_mapping({"bridges": [bridge]}).bridges[0].subscriptions == (("g", "*"),)
