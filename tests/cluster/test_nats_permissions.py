"""Per-broker NATS permissions (docs/cluster.md): a real nats-server enforces
them.  Brokers route, prove alive and answer queries with only their own
subjects and replies; a broker's credentials cannot publish on another
broker's subjects; a user without publish rights is refused everything."""

from __future__ import annotations

import pytest
import trio

from clients.skan import SkanClient
from tests.cluster.natsproc import (
    NatsCluster,
    cluster_broker,
    permissions_conf,
    send_until_received,
    wait_cluster,
)
from tests.cluster.rawnats import RawNats, run
from tests.hardening.bystander import tracebacks
from toolkit.eventer_client import EventerClient
from wire import eventer as w
from wire import nats
from wire.skan import encode_frame

pytestmark = pytest.mark.trio

ATTACKER = """    {user: "snoop", password: "snoop-pw", permissions: {
      publish: {deny: [">"]}
      subscribe: {allow: [">"]}
    }}
"""


def creds(server_id: int) -> str:
    return f'user = "broker-{server_id}"\npassword = "pw-{server_id}"\n'


def forged(sender: str, text: bytes) -> bytes:
    return encode_frame({"type": "send", "from": sender, "to": "*", "group": "g",
                         "instance": "i", "seq": "1", "msg": text})


async def test_per_broker_permissions_enforced_by_nats(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(permissions_conf({1: "pw-1", 2: "pw-2"}, ATTACKER))
    with NatsCluster(1, ("-c", str(conf))) as cluster:
        url = cluster.nodes[0].url
        with cluster_broker(1, url, cluster=creds(1)) as a, \
                cluster_broker(2, url, cluster=creds(2)) as b:
            async with SkanClient.connect(*a.skan) as on_a, SkanClient.connect(*b.skan) as on_b:
                await on_a.subscribe("g")
                await on_b.subscribe("g")
                # Heartbeats, pings (answered as replies), interest: both seen.
                await wait_cluster(on_a, 2, known=True, timeout=20)
                await wait_cluster(on_b, 2, known=True, timeout=20)
                await send_until_received(on_a, on_b, "g", "a-to-b", timeout=10, poll=0.3)
                await send_until_received(on_b, on_a, "g", "b-to-a", timeout=10, poll=0.3)
                # A query crosses: broker 2 answers broker 1 with a reply.
                async with EventerClient.connect(*b.addr["eventer"], "t") as ev_b:
                    await ev_b.register([w.RegisterEvent(("q", "x"))])
                async with EventerClient.connect(*a.addr["eventer"], "t") as ev_a:
                    with trio.fail_after(10):
                        while True:
                            found = await ev_a.query(w.QueryTimeseriesParams(
                                event_types=(("q", "*"),)))
                            if found.events:
                                break
                            await trio.sleep(0.2)
                    assert found.events[0].id.server == 2

                # Broker 1's credentials: not on broker 2's subjects.
                as_1 = await RawNats.open(url, user="broker-1", **{"pass": "pw-1"})
                await as_1.send(run(b"sk.2.g.i._", 2, 1, [forged("0_1@h/2", b"as-2")])
                                + nats.pub(b"skc.hb.2", b'{"server": 2, "boot": "0" * 16}')
                                + nats.pub(b"skc.query.2", b"{}", b"_INBOX.x"))
                await as_1.flush()
                await trio.sleep(0.3)
                await as_1.flush()
                violations = [e for e in as_1.errors if "Permissions Violation" in e]
                assert len(violations) == 3, as_1.errors
                assert all("Publish" in e for e in violations)
                # What a broker's own credentials still do (threat model): speak
                # as that broker, to its own subjects.
                await as_1.send(run(b"sk.1.g.i._", 1, 1, [forged("0_1@h/1", b"as-1")]))
                await as_1.flush()

                # A user without publish rights: refused on every subject.
                snoop = await RawNats.open(url, user="snoop", **{"pass": "snoop-pw"})
                await snoop.send(run(b"sk.1.g.i._", 1, 2, [forged("0_1@h/1", b"snooped")])
                                 + nats.pub(b"skc.query.1", b"{}", b"_INBOX.y")
                                 + nats.pub(b"skc.int.1", b"SKI 1 1 hello 0 1\n"))
                await snoop.flush()
                await trio.sleep(0.3)
                await snoop.flush()
                assert len([e for e in snoop.errors if "Permissions Violation" in e]) == 3
                got = []
                with trio.move_on_after(1.0):
                    while True:
                        got.append((await on_b.receive()).msg)
                assert b"as-2" not in got and b"snooped" not in got
                assert b"as-1" in got
                await as_1.aclose()
                await snoop.aclose()
    for broker in (a, b):
        assert tracebacks(broker.stderr_lines) == []
        assert not [line for line in broker.stderr_lines if "Permissions Violation" in line]
