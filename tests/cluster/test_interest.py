"""Remote interest: the announcements, their tracking, and what the backplane
publishes with them (pure: routers joined by the in-memory NATS)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.cluster import interest
from broker.cluster.backplane import Backplane
from broker.cluster.interest import Announcer, RemoteInterest, escape, unescape
from broker.core.router import NORMAL, PROMISC, Router
from tests.cluster.fakenats import FakeNats
from tests.cluster.test_backplane_property import Recorder, attach_as, lname
from wire.errors import ProtocolError
from wire.skan import decode_header, encode_frame

BLIND, EXPIRE = 2.0, 3.0


@given(st.binary(max_size=300))
def test_tokens_round_trip(group):
    token = escape(group)
    assert token and token != interest.EVERYTHING and b"\n" not in token and b" " not in token
    assert unescape(token) == group


@pytest.mark.parametrize("token", [b"a%4", b"a%zz", b"a b", b"a.b", b"%4a"])
def test_bad_tokens_are_refused(token):
    with pytest.raises(ProtocolError):
        unescape(token)


def known(groups: list[bytes], everything: bool = False, server: int = 2,
          part_bytes: int = interest.PART_BYTES) -> tuple[RemoteInterest, Announcer]:
    remote = RemoteInterest(1, BLIND, EXPIRE)
    remote.reset(0.0)
    ann = Announcer(server)
    for payload in ann.full(groups, everything, hello=False, part_bytes=part_bytes):
        remote.receive(payload, 0.0)
    remote.tick(BLIND)
    return remote, ann


def test_unknown_until_the_blind_window_ends():
    remote = RemoteInterest(1, BLIND, EXPIRE)
    assert remote.wanted is None  # never connected
    remote.reset(10.0)
    remote.tick(10.0 + BLIND / 2)
    assert remote.wanted is None
    remote.tick(10.0 + BLIND)
    assert remote.wanted == set()  # nobody else announced anything


def test_full_set_then_deltas():
    remote, ann = known([b"g", b"a.b"])
    assert remote.wanted == {b"g", b"a.b"}
    remote.receive(ann.delta(b"h", True), BLIND)
    remote.receive(ann.delta(b"g", False), BLIND)
    assert remote.wanted == {b"a.b", b"h"}
    remote.receive(ann.delta(None, True), BLIND)
    assert remote.wanted is None  # everything
    remote.receive(ann.delta(None, False), BLIND)
    assert remote.wanted == {b"a.b", b"h"}
    assert remote.brokers() == {2: "known"}


def test_a_gap_makes_a_broker_unknown_until_its_next_full_set():
    remote, ann = known([b"g"])
    ann.delta(b"h", True)  # lost
    remote.receive(ann.delta(b"k", True), BLIND)
    assert remote.wanted is None and remote.brokers() == {2: "unknown"}
    for payload in ann.full([b"g", b"h", b"k"], False, hello=False):
        remote.receive(payload, BLIND)
    assert remote.wanted == {b"g", b"h", b"k"}


def test_a_full_set_in_parts_applies_when_complete():
    groups = [b"group-%d" % i for i in range(50)]
    remote, ann = known(groups, part_bytes=64)
    assert remote.wanted == set(groups)
    payloads = ann.full(groups[:20], False, hello=False, part_bytes=64)
    assert len(payloads) > 2
    remote.receive(payloads[0], BLIND)
    assert remote.wanted == set(groups)  # the old set holds until the new one is complete
    remote.receive(payloads[2], BLIND)  # payloads[1] lost
    assert remote.wanted is None


def test_a_broker_heard_but_not_announced_is_unknown_and_forgotten_when_silent():
    remote, _ann = known([b"g"])
    remote.heard(2, 1.0)
    remote.heard(3, 1.0)  # a heartbeat, no interest yet
    remote.tick(BLIND)
    assert remote.wanted is None
    remote.tick(1.0 + EXPIRE)  # both silent since: forgotten
    assert remote.wanted == set() and remote.brokers() == {}


def test_hello_asks_for_an_answer_and_malformed_is_refused():
    remote = RemoteInterest(1, BLIND, EXPIRE)
    remote.reset(0.0)
    [hello] = Announcer(2).full([b"g"], False, hello=True)
    assert remote.receive(hello, 0.0) is True
    for bad in (b"", b"SKI x 1 full 0 1\n", b"SKI 2 9 + \ng\nh\n", b"SKI 2 10 full 3 1\n",
                b"SKI 2 11 ? \ng\n", b"SKI 2 12 full 0 1\ng"):
        with pytest.raises(ProtocolError):
            remote.receive(bad, 0.0)
    assert remote.receive(hello, 0.0) is True  # recovers with the next full set


# ---- the backplane with announcements -----------------------------------


def cluster(n: int = 2):
    routers = [Router(server_id=k + 1) for k in range(n)]
    bps = [Backplane(r, r.server_id, heartbeat=0.0) for r in routers]
    fake = FakeNats(bps)
    log: Counter = Counter()
    clients = []
    for k, r in enumerate(routers):
        ep = Recorder(log, k)
        attach_as(r, ep, lname(k, k))
        clients.append(ep)
    fake.connect()
    return routers, bps, fake, clients, log


def send(router: Router, ep, group: bytes, to: bytes = b"*") -> bytes:
    frame = encode_frame({"type": "send", "group": group, "instance": b"1", "to": to,
                          "from": ep.lname, "seq": b"1", "msg": b"m"})
    router.route(ep, frame, decode_header(frame, 4))
    router.end_batch()
    return frame


def test_nothing_is_published_without_remote_interest():
    routers, bps, fake, clients, log = cluster()
    routers[0].subscribe(clients[0], b"g", b"*", NORMAL)  # local interest only
    fake.pump()
    for _ in range(5):
        send(routers[0], clients[0], b"g")
    fake.pump()
    assert fake.published == 0 and bps[0].stats.sent == 0 and bps[0].stats.withheld == 5
    assert log == Counter()  # never to the sender


def test_a_subscription_on_b_is_served_once_announced():
    routers, bps, fake, clients, log = cluster()
    send(routers[0], clients[0], b"g")
    fake.pump()
    routers[1].subscribe(clients[1], b"g", b"1", NORMAL)
    fake.pump()  # B's SUB and its delta
    frame = send(routers[0], clients[0], b"g")
    fake.pump()
    assert log == Counter({(1, frame): 1}) and fake.published == 1
    routers[1].unsubscribe(clients[1], b"g", b"1")
    fake.pump()
    send(routers[0], clients[0], b"g")
    fake.pump()
    assert fake.published == 1 and bps[0].stats.withheld == 2


def test_directed_to_another_broker_is_published_without_group_interest():
    # (B then applies the routing rules: its client, not subscribed to g, gets nothing.)
    routers, bps, fake, clients, _log = cluster()
    send(routers[0], clients[0], b"g", to=clients[1].lname)
    fake.pump()
    assert fake.published == 1 and bps[1].stats.received == 1
    send(routers[0], clients[0], b"g", to=clients[0].lname)  # our own client's: nobody else
    send(routers[0], clients[0], b"g", to=b"nobody@host")  # no broker's: promisc only
    fake.pump()
    assert fake.published == 1 and bps[0].stats.withheld == 2


def test_promisc_and_wildcard_patterns_elsewhere_take_directed_and_any_group():
    routers, _bps, fake, clients, log = cluster(3)
    routers[1].subscribe(clients[1], b"g", b"*", PROMISC)
    routers[2].subscribe_pattern(clients[2], (b"*",), NORMAL)
    fake.pump()
    frame = send(routers[0], clients[0], b"g", to=clients[0].lname)
    other = send(routers[0], clients[0], b"zz")
    fake.pump()
    assert log[(1, frame)] == 1 and log[(2, other)] == 1


def test_a_broker_connecting_later_learns_the_others_interest():
    routers, bps, fake, clients, log = cluster()
    routers[0].subscribe(clients[0], b"g", b"*", NORMAL)
    fake.pump()
    bps[0]._last_hello = -1.0  # (the fake NATS clock stands still)
    bps[1].connected(0.0)  # B reconnects: forgets, says hello; A answers
    fake.pump()
    assert bps[1].remote.wanted == {b"g"}
    frame = send(routers[1], clients[1], b"g")
    fake.pump()
    assert log == Counter({(0, frame): 1})


def test_while_disconnected_everything_counts_as_published():
    routers, bps, _fake, clients, _log = cluster()
    bps[0].remote.disconnected()
    send(routers[0], clients[0], b"g")
    assert bps[0].stats.withheld == 0 and bps[0].stats.sent == 1
