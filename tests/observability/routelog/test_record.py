"""Routing-log records: every field, JSON escaping of raw bytes, the fragment cache."""

from __future__ import annotations

import json

import pytest

from broker.core.router import MEONLY, NORMAL, PROMISC, Endpoint, Routed, Router
from broker.observability.routelog.record import (
    FIELDS,
    PARTS_CACHE,
    RecordBuffer,
    format_records,
    json_str,
)
from wire.skan import decode_header, encode_frame


class Sink(Endpoint):
    def __init__(self, protocol: str = "skan") -> None:
        super().__init__()
        self.protocol = protocol

    def deliver(self, frame: bytes, routed: Routed) -> None:
        pass


def sink(router: Router, protocol: str = "skan") -> Sink:
    ep = Sink(protocol)
    router.attach(ep)
    return ep


def send(router: Router, sender: Endpoint, group=b"g", instance=b"*", to=b"*", seq=b"1",
         **extra) -> Routed:
    frame = encode_frame({"type": "send", "from": sender.lname, "to": to, "group": group,
                          "instance": instance, "seq": seq, "msg": b"payload", **extra})
    routed = router.route(sender, frame, decode_header(frame, 4))
    router.end_batch()  # one message, one batch: observers see it now
    return routed


def records(routed: list[Routed]) -> list[dict]:
    text = format_records(routed)
    assert text.endswith("\n") and text.count("\n") == len(routed)
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def router() -> Router:
    return Router(hostname="test", clock=lambda: 1718000000.25)


def test_fields_of_a_delivered_message(router):
    pub, a, b, c = sink(router), sink(router), sink(router, "eventer"), sink(router, "mariner")
    router.subscribe(a, b"g", b"*", NORMAL)
    router.subscribe(b, b"g", b"i1", NORMAL)
    router.subscribe(c, b"g", b"*", MEONLY)  # not reached by to="*"
    routed = send(router, pub, instance=b"i1", seq=b"42")
    (rec,) = records([routed])
    assert list(rec) == list(FIELDS)
    assert rec == {
        "time_us": 1718000000250000, "server": 0, "lname": pub.lname.decode(),
        "proto": "skan", "user": None, "group": "g", "instance": "i1", "to": "*", "seq": "42",
        "size": len(routed.frame),
        "recipients": {"eventer": 1, "skan": 1}, "delivered": 2, "undeliverable": False,
    }


def test_user_of_an_authenticated_sender(router):
    from broker.core.auth import Principal

    pub = sink(router)
    pub.principal = Principal(name="sensor-7", perms=None, via="token")
    (rec,) = records([send(router, pub)])
    assert rec["user"] == "sensor-7"


def test_undeliverable_and_directed(router):
    pub, target, promisc = sink(router, "hsp"), sink(router), sink(router, "mariner")
    router.subscribe(target, b"g", b"*", MEONLY)
    router.subscribe(promisc, b"g", b"*", PROMISC)
    nobody = send(router, pub, group=b"empty")
    directed = send(router, pub, to=target.lname)
    recs = records([nobody, directed])
    assert recs[0]["recipients"] == {} and recs[0]["delivered"] == 0
    assert recs[0]["undeliverable"] is True and recs[0]["proto"] == "hsp"
    assert recs[1]["to"] == target.lname.decode()
    assert recs[1]["recipients"] == {"mariner": 1, "skan": 1} and recs[1]["delivered"] == 2


def test_sender_is_left_out_of_its_own_recipients(router):
    a, b = sink(router), sink(router, "hsp")
    router.subscribe(a, b"g", b"*", NORMAL)
    router.subscribe(b, b"g", b"*", NORMAL)
    # Both share one cached recipient tuple; each one's record leaves itself out.
    recs = records([send(router, a), send(router, b), send(router, a)])
    assert [r["recipients"] for r in recs] == [{"hsp": 1}, {"skan": 1}, {"hsp": 1}]
    assert [r["delivered"] for r in recs] == [1, 1, 1]


def test_subscription_change_updates_cached_recipients(router):
    pub, a, b = sink(router), sink(router), sink(router, "eventer")
    router.subscribe(a, b"g", b"*", NORMAL)
    buf = RecordBuffer(1000, lambda: None)
    buf.add(send(router, pub))
    router.subscribe(b, b"g", b"*", NORMAL)
    buf.add(send(router, pub))
    router.detach(a)
    buf.add(send(router, pub))
    recs = [json.loads(line) for line in buf.take()]
    assert [r["recipients"] for r in recs] == [{"skan": 1}, {"eventer": 1, "skan": 1},
                                               {"eventer": 1}]


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"plain-ASCII 1.2/x", "plain-ASCII 1.2/x"),
        (b'quo"te', 'quo"te'),
        (b"back\\slash", "back\\slash"),
        (b"tab\tnl\ncr\rnul\x00", "tab\tnl\ncr\rnul\x00"),
        ("grüße/温度".encode(), "grüße/温度"),
        (b"bad\xff\xfeutf8", "bad\\xff\\xfeutf8"),
        (b"", ""),
    ],
)
def test_json_escaping_of_raw_bytes(router, raw, text):
    assert json.loads(json_str(raw)) == text
    pub, sub = sink(router), sink(router)
    router.subscribe(sub, raw, raw, NORMAL)
    (rec,) = records([send(router, pub, group=raw, instance=raw, seq=raw)])
    assert (rec["group"], rec["instance"], rec["seq"]) == (text, text, text)
    assert rec["delivered"] == 1


def test_lines_are_plain_strings_and_buffer_calls_on_full(router):
    pub = sink(router)
    full = []
    buf = RecordBuffer(3, lambda: full.append(len(buf.lines)))
    router.observers.append(buf.observe)
    for _ in range(7):
        send(router, pub)
        router.end_batch()
    assert full == [3, 4, 5, 6, 7]  # on_full until someone takes the lines
    assert len(buf.take()) == 7 and buf.lines == []


def test_fragment_cache_is_bounded(router):
    pub = sink(router)
    buf = RecordBuffer(1 << 30, lambda: None)
    for i in range(PARTS_CACHE + 10):
        buf.add(send(router, pub, group=b"g%d" % i))
    assert len(buf._parts) <= PARTS_CACHE
    last = json.loads(buf.lines[-1])
    assert last["group"] == f"g{PARTS_CACHE + 9}"


def test_routing_keys_with_equal_recipients_keep_their_own_fields(router):
    # The cache relies on the router building one tuple per routing key: two
    # keys with the same subscriber set must still log their own group.
    pub, sub = sink(router), sink(router)
    for g in (b"g1", b"g2"):
        router.subscribe(sub, g, b"*", NORMAL)
    routed = [send(router, pub, group=g, instance=i)
              for g in (b"g1", b"g2", b"g1") for i in (b"*", b"a")]
    recs = records([*routed, send(router, pub, group=b"none1"), send(router, pub, group=b"n2")])
    assert [(r["group"], r["instance"], r["delivered"]) for r in recs] == [
        ("g1", "*", 1), ("g1", "a", 1), ("g2", "*", 1), ("g2", "a", 1), ("g1", "*", 1),
        ("g1", "a", 1), ("none1", "*", 0), ("n2", "*", 0)]


def test_cache_lets_go_of_old_endpoints_after_a_change(router):
    pub, sub = sink(router), sink(router)
    router.subscribe(sub, b"g", b"*", NORMAL)
    buf = RecordBuffer(1 << 30, lambda: None, router)
    buf.add(send(router, pub))
    assert any(sub in parts[2] for parts in buf._parts.values())
    router.detach(sub)
    buf.add(send(router, pub))
    assert not any(sub in parts[2] for parts in buf._parts.values())
    assert json.loads(buf.lines[-1])["recipients"] == {}


def test_missing_or_nested_seq_is_logged_empty(router):
    pub = sink(router)
    routed = []
    for seq in ({}, [b"1"], None):
        message = {"type": "send", "from": pub.lname, "to": "*", "group": "g", "instance": "*",
                   "msg": b"m"}
        if seq is not None:
            message["seq"] = seq
        frame = encode_frame(message)
        routed.append(router.route(pub, frame, decode_header(frame, 4)))
    assert [r["seq"] for r in records(routed)] == ["", "", ""]
