"""K routers joined by a fake NATS deliver exactly what one router holding every
endpoint delivers: the same (connection, frame) multiset, for random mixes of
subscriptions (normal, meonly, promisc, Hat patterns) and sends (broadcast,
instance "*", directed, replies)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster.backplane import Backplane
from broker.core.router import NORMAL, PROMISC, SUBTYPES, Endpoint, Routed, Router
from tests.cluster.fakenats import FakeNats
from tests.examples import examples
from wire.skan import decode_header, encode_frame

CLIENTS = 6
GROUPS = [b"g", b"h", b"a.b"]
INSTANCES = [b"1", b"2", b"*", b"x/y"]


class Recorder(Endpoint):
    def __init__(self, log: Counter, name: int) -> None:
        super().__init__()
        self.log = log
        self.name = name

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.log[(self.name, frame)] += 1


def attach_as(router: Router, ep: Endpoint, lname: bytes) -> None:
    router.attach(ep)
    del router.endpoints[ep.lname]
    ep.lname = lname
    router.endpoints[lname] = ep


def lname(i: int, k: int) -> bytes:
    return b"5f_%x0123456789abcdef@host/%d" % (i, k + 1)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("sub"), st.integers(0, CLIENTS - 1), st.sampled_from(GROUPS),
                  st.sampled_from(INSTANCES), st.sampled_from(sorted(SUBTYPES))),
        st.tuples(st.just("unsub"), st.integers(0, CLIENTS - 1), st.sampled_from(GROUPS),
                  st.sampled_from(INSTANCES)),
        st.tuples(st.just("pattern"), st.integers(0, CLIENTS - 1),
                  st.sampled_from([(b"g", b"*"), (b"*",), (b"h", b"?"), (b"a.b", b"x", b"y")]),
                  st.sampled_from([NORMAL, PROMISC])),
        st.tuples(st.just("send"), st.integers(0, CLIENTS - 1), st.sampled_from(GROUPS),
                  st.sampled_from(INSTANCES), st.integers(-2, CLIENTS - 1), st.booleans()),
    ),
    max_size=40,
)


def run(ops_list, brokers: int, *, single: bool = False, batched: bool = False,
        announce: bool = True) -> Counter:
    """Client i lives on broker i % brokers (its lname names that broker);
    ``single`` puts every client on one router (the reference).  ``batched``
    routes consecutive sends as one routing batch per router (as a received
    chunk is), so they reach NATS as runs of several messages.  ``announce``:
    the brokers exchange their interest (hello at connect, deltas, no blind
    window) and publish only what another broker wants; without it they
    publish everything, as while interest is unknown."""
    log: Counter = Counter()
    routers = [Router(server_id=k + 1) for k in range(1 if single else brokers)]
    backplanes = [Backplane(r, r.server_id, heartbeat=0.0) for r in routers] if not single else []
    fake = FakeNats(backplanes)
    fake.pump()  # subscriptions made at connect, before any traffic
    if announce:
        fake.connect()
    eps = []
    for i in range(CLIENTS):
        router = routers[0 if single else i % brokers]
        ep = Recorder(log, i)
        attach_as(router, ep, lname(i, i % brokers))
        eps.append((router, ep))
    seq = 0

    def end_batches() -> None:
        for r in routers:
            r.end_batch()
        fake.pump()

    for op in ops_list:
        kind, i = op[0], op[1]
        router, ep = eps[i]
        if batched and kind != "send":
            end_batches()  # a subscription change comes after the sends before it
        if kind == "sub":
            router.subscribe(ep, op[2], op[3], SUBTYPES[op[4]])
        elif kind == "unsub":
            router.unsubscribe(ep, op[2], op[3])
        elif kind == "pattern":
            router.subscribe_pattern(ep, op[2], op[3])
        else:
            _, _, group, instance, target, reply = op
            to = {-1: b"*", -2: b"nobody@host/9"}.get(target) or eps[target][1].lname
            seq += 1
            fields = {"type": "send", "group": group, "instance": instance, "to": to,
                      "from": ep.lname, "seq": str(seq).encode(), "msg": b"m"}
            if reply:
                fields["repl"] = b"1"
            frame = encode_frame(fields)
            router.route(ep, frame, decode_header(frame, 4))
            if batched:
                continue
            router.end_batch()
        fake.pump()
    end_batches()
    return log


@settings(max_examples=examples(300), deadline=None)
@given(ops)
def test_cluster_delivers_what_one_router_delivers(ops_list):
    for brokers in (2, 3):
        reference = run(ops_list, brokers, single=True)
        assert run(ops_list, brokers) == reference
        assert run(ops_list, brokers, announce=False) == reference


@settings(max_examples=examples(200), deadline=None)
@given(ops)
def test_batched_sends_deliver_what_one_router_delivers(ops_list):
    for brokers in (2, 3):
        assert run(ops_list, brokers, batched=True) == run(ops_list, brokers, single=True)


def test_overlapping_subscriptions_deliver_once():
    # A client subscribed to its group on broker 2, receiving a message directed
    # to it from broker 1: NATS matches both the group subject and the
    # directed-to-broker-2 subject; the dedupe window drops the second copy.
    ops_list = [("sub", 1, b"g", b"1", b"normal"), ("send", 0, b"g", b"1", 1, False)]
    log = run(ops_list, 2)
    assert sum(log.values()) == 1



def test_event_id_and_timestamp_are_the_origins():
    """One EventId and timestamp per message cluster-wide: the broker it entered assigns them."""
    seen: list[Routed] = []
    routers = [Router(server_id=7, clock=lambda: 1700000000.123456789),
               Router(server_id=9, clock=lambda: 5.0)]
    backplanes = [Backplane(r, r.server_id) for r in routers]
    fake = FakeNats(backplanes)
    fake.pump()
    pub, sub = Recorder(Counter(), 0), Recorder(Counter(), 1)
    attach_as(routers[0], pub, lname(0, 6))  # an lname of broker 7: it speaks for 7
    attach_as(routers[1], sub, lname(1, 8))
    routers[1].subscribe(sub, b"g", b"*", NORMAL)
    routers[1].observers.append(seen.extend)
    fake.pump()
    frame = encode_frame({"type": "send", "group": "g", "instance": "1", "to": "*",
                          "from": pub.lname, "seq": "1", "msg": b"m"})
    sent = routers[0].route(pub, frame, decode_header(frame, 4))
    routers[0].end_batch()
    fake.pump()
    [got] = seen
    assert (got.server, got.session, got.instance, got.timestamp) == (
        7, sent.session, sent.instance, 1700000000.123456789)
    assert got.frame == frame


def test_each_broker_keeps_only_what_entered_it():
    """Retention (Eventer queries, Mariner replay) sees local messages only; observers
    such as the routing log see every routed message; events keep the origin's id."""
    from broker.core.events import event_from_routed
    from broker.core.retention import RetentionStore

    routers = [Router(server_id=1), Router(server_id=2)]
    stores = [RetentionStore(100), RetentionStore(100)]
    for router, store in zip(routers, stores, strict=True):
        store.attach(router)
    backplanes = [Backplane(r, r.server_id) for r in routers]
    fake = FakeNats(backplanes)
    seen: list[Routed] = []
    routers[1].observers.append(seen.extend)
    clients = [Recorder(Counter(), i) for i in range(2)]
    for i, c in enumerate(clients):
        attach_as(routers[i], c, lname(i, i))
        routers[i].subscribe(c, b"g", b"*", NORMAL)
    fake.pump()
    for i, c in enumerate(clients):
        frame = encode_frame({"type": "send", "group": "g", "instance": "1", "to": "*",
                              "from": c.lname, "seq": "1", "msg": b"m"})
        routers[i].route(c, frame, decode_header(frame, 4))
        routers[i].end_batch()
        fake.pump()
    assert [len(s) for s in stores] == [1, 1]  # each its own message only
    assert sorted(r.server for r in seen) == [1, 2]  # both routed on broker 2
    remote = next(r for r in seen if r.server == 1)
    assert event_from_routed(remote, 2).id.server == 1
