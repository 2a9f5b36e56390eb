"""A run from NATS routed in one pass (broker.cluster.inbound) does exactly what
routing it frame by frame does: same deliveries, Routed fields, counters,
per-group statistics and observer input, in both SKAN_PURE_PYTHON modes
(the test suite's decoder; ``run_key`` takes the decoder as a parameter too)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster import inbound
from broker.cluster.backplane import Backplane, RemoteSender
from broker.core.router import SUBTYPES, Endpoint, Routed, Router
from broker.core.skan_handler import decode_send, decode_send_py
from broker.observability.routelog.record import RecordBuffer
from tests.examples import examples
from wire.skan import encode_frame

GROUPS = ["g", "h"]
INSTANCES = ["1", "*", "x/y"]


class Recorder(Endpoint):
    def __init__(self, name: bytes, batched: bool = False) -> None:
        super().__init__()
        self.name = name
        self.batched = batched
        self.got: list[tuple] = []
        self.flushes = 0

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append((frame, routed.server, routed.session, routed.instance,
                         routed.timestamp, routed.sender.lname,
                         tuple(ep.lname for ep in routed.recipients)))
        # (``delivered`` is final only for observers: compared through them.)

    def flush(self) -> None:
        self.flushes += 1


def broker(subs: list[tuple[int, str, str, str]]) -> tuple[Router, Backplane, list[Recorder],
                                                          list[list[Routed]], list[list[Routed]]]:
    """Broker 2 with three clients (the last one batched) holding ``subs``."""
    router = Router(server_id=2)
    router.group_stats = {}
    bp = Backplane(router, 2)
    clients = [Recorder(b"c%d" % i, batched=i == 2) for i in range(3)]
    for c in clients:
        router.attach(c)
        del router.endpoints[c.lname]
        c.lname = c.name
        router.endpoints[c.name] = c
    for i, group, instance, subtype in subs:
        router.subscribe(clients[i], group.encode(), instance.encode(), SUBTYPES[subtype.encode()])
    seen: list[list[Routed]] = []
    local: list[list[Routed]] = []
    router.observers.append(seen.append)
    router.local_observers.append(local.append)
    return router, bp, clients, seen, local


def send(group: str, instance: str, to: str, sender: str, seq: int, reply: bool) -> bytes:
    msg = {"type": "send", "group": group, "instance": instance, "to": to,
           "from": sender, "seq": str(seq), "msg": b"x" * (seq % 7)}
    if reply:
        msg["reply"] = "1"
    return encode_frame(msg)


def observed(batches: list[list[Routed]]) -> list[tuple]:
    return [(r.frame, r.server, r.session, r.instance, r.timestamp, r.delivered)
            for batch in batches for r in batch]


subscriptions = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(GROUPS),
                                   st.sampled_from(INSTANCES), st.sampled_from(sorted(
                                       s.decode() for s in SUBTYPES))), max_size=6)
keys = st.tuples(st.sampled_from(GROUPS), st.sampled_from(INSTANCES),
                 st.sampled_from(["*", "c0", "c1", "c2", "nobody"]),
                 st.sampled_from(["p@a/1", "q@a/1"]), st.booleans())


@settings(max_examples=examples(150), deadline=None)
@given(subscriptions, st.lists(keys, min_size=1, max_size=6), st.integers(1, 30),
       st.booleans())
def test_one_pass_routes_as_frame_by_frame(subs, plan, length, uniform):
    """Uniform runs (one key) take the one-pass path, others fall back; both
    must match routing every frame through Router.route."""
    keyed = [plan[0]] * length if uniform else [plan[i % len(plan)] for i in range(length)]
    frames = [send(*k[:4], i, k[4]) for i, k in enumerate(keyed)]
    stamps = [1700000000.0 + i / 7 for i in range(length)]
    results = []
    for fast in (True, False):
        router, bp, clients, seen, local = broker(subs)
        if fast:
            found = inbound.run_key(frames)
            if found is None:
                bp.route_frames(b"sk.t", 1, 77, 5, stamps, frames)
            else:
                lname, headers, key = found
                router.route_run(bp._sender(lname), frames, headers, key, (1, 77, 5), stamps)
                bp.stats.received += length
        else:
            bp.route_frames(b"sk.t", 1, 77, 5, stamps, frames)
        router.end_batch()
        c = router.counters
        results.append(([cl.got for cl in clients], clients[2].flushes > 0,
                         (c.msgs_in, c.bytes_in, c.msgs_out, c.bytes_out, c.undeliverable),
                         router.group_stats, observed(seen), local, bp.stats.received))
    assert results[0] == results[1]
    # A run of one key and one sender always takes the one-pass path.
    if uniform:
        assert inbound.run_key(frames) is not None


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(keys, min_size=1, max_size=4), st.integers(1, 8))
def test_run_key_agrees_with_the_python_decoder(plan, length):
    frames = [send(*plan[i % len(plan)][:4], i, plan[i % len(plan)][4]) for i in range(length)]
    assert inbound.run_key(frames, decode_send) == inbound.run_key(frames, decode_send_py)


def test_runs_that_are_not_one_key_of_sends_fall_back():
    a = send("g", "1", "*", "p@a/1", 1, False)
    assert inbound.run_key([a, a]) is not None
    assert inbound.run_key([a, send("g", "2", "*", "p@a/1", 2, False)]) is None  # two keys
    assert inbound.run_key([a, send("g", "1", "*", "q@a/1", 2, False)]) is None  # two senders
    assert inbound.run_key([a, send("g", "1", "*", "p@a/1", 2, True)]) is None  # a reply
    assert inbound.run_key([a, encode_frame({"type": "stats", "seq": "1"})]) is None
    assert inbound.run_key([a, a[:4] + b"Skun" + a[8:]]) is None  # malformed
    assert inbound.run_key([encode_frame({"type": "send", "from": {"x": "1"}})]) is None


def test_a_malformed_frame_in_a_run_is_counted_and_the_rest_delivered():
    _router, bp, clients, _seen, _local = broker([(0, "g", "*", "normal")])
    good = [send("g", "1", "*", "p@a/1", i, False) for i in range(3)]
    bad = encode_frame({"type": "send", "group": "g"})  # no instance, to, from
    bp.route_frames(b"sk.g.1._", 1, 1, 1, [0.0] * 4, [good[0], bad, *good[1:]])
    assert [g[0] for g in clients[0].got] == good
    assert (bp.stats.malformed, bp.stats.received) == (1, 3)


def test_remote_senders_keep_their_lnames_in_the_routing_log():
    """Two publishers of one broker on one group: the receiving broker's routing
    log names each (one RemoteSender per lname; the log caches per sender)."""
    router, bp, _clients, _seen, _local = broker([(0, "g", "*", "normal")])
    log = RecordBuffer(1000, lambda: None, router)
    router.observers.append(log.observe)
    for session, who in enumerate(["p@a/1", "q@a/1", "p@a/1"]):
        frames = [send("g", "1", "*", who, i, False) for i in range(2)]
        lname, headers, key = inbound.run_key(frames)
        router.route_run(bp._sender(lname), frames, headers, key, (1, session + 1, 1),
                         [0.0, 0.0])
    router.end_batch()
    names = [line.split('"lname":"')[1].split('"')[0] for line in log.take()]
    assert names == ["p@a/1"] * 2 + ["q@a/1"] * 2 + ["p@a/1"] * 2
    assert isinstance(bp._sender(b"p@a/1"), RemoteSender)
    assert bp._sender(b"p@a/1") is bp._sender(b"p@a/1")


def test_remote_senders_are_bounded(monkeypatch):
    monkeypatch.setattr("broker.cluster.backplane.SENDER_CACHE_LIMIT", 4)
    router = Router(server_id=2)
    bp = Backplane(router, 2)
    for i in range(10):
        bp._sender(b"s%d" % i)
    assert len(bp._senders) <= 4


def test_nothing_received_goes_to_local_observers_or_back_out():
    router, bp, clients, seen, local = broker([(0, "g", "*", "normal")])
    bp.take_pending()  # its own subscriptions
    frames = [send("g", "1", "*", "p@a/1", i, False) for i in range(5)]
    lname, headers, key = inbound.run_key(frames)
    router.route_run(bp._sender(lname), frames, headers, key, (1, 3, 1), [0.0] * 5)
    router.end_batch()
    assert local == [] and len(observed(seen)) == 5
    assert bp.take_pending() == b"" and bp.stats.sent == 0
    assert len(clients[0].got) == 5
