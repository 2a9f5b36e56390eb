"""Runs: a batch's messages travel to NATS as few NATS messages, and come out of
them as the same frames, in order, with their origin's EventIds and timestamps."""

from __future__ import annotations

import logging
import struct

import pytest

from broker.cluster.backplane import Backplane
from broker.cluster.ratelog import RateLimitedLog
from broker.cluster.subject_runs import RUN_BYTES, encode_run, pack_stamps, parse_origin, unpack_run
from broker.core.router import NORMAL, Endpoint, Routed, Router
from tests.cluster.fakenats import FakeNats, parse_commands
from wire import nats
from wire.errors import LimitError, MalformedError
from wire.skan import decode_header, encode_frame


class Recorder(Endpoint):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[Routed] = []

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(routed)


def pair(clock_a=None) -> tuple[list[Router], list[Backplane], FakeNats, Recorder, Recorder]:
    """Broker 1 with a publisher, broker 2 with a subscriber of every instance of g and h."""
    routers = [Router(server_id=1, **({"clock": clock_a} if clock_a else {})),
               Router(server_id=2)]
    backplanes = [Backplane(r, r.server_id) for r in routers]
    fake = FakeNats(backplanes)
    pub, sub = Recorder(), Recorder()
    routers[0].attach(pub)
    routers[1].attach(sub)
    for group in (b"g", b"h"):
        routers[1].subscribe(sub, group, b"*", NORMAL)
    fake.pump()
    return routers, backplanes, fake, pub, sub


def send(router: Router, pub: Endpoint, seq: int, group: str = "g", instance: str = "1",
         size: int = 100) -> Routed:
    frame = encode_frame({"type": "send", "group": group, "instance": instance, "to": "*",
                          "from": pub.lname, "seq": str(seq), "msg": b"x" * size})
    return router.route(pub, frame, decode_header(frame, 4))


def hpubs(data: bytes) -> list[tuple[bytes, int]]:
    """(subject, messages in the run) of each HPUB."""
    return [(args[0], parse_origin(body[:int(args[-2])])[3])
            for op, args, body in parse_commands(data) if op == b"HPUB"]


def test_run_round_trip_is_exact():
    frames = [encode_frame({"type": "send", "seq": str(i)}) for i in range(3)]
    stamps = [1700000000.123456789, 5e-324, 2.0**49 - 0.5]
    size = sum(map(len, frames)) + 8 * len(frames)
    cmd = b"".join(encode_run(b"sk.4.g.1._", 4, 2**63 - 8, 7, pack_stamps(stamps), frames,
                              size, b"al%2Eice"))
    [(op, args, body)] = parse_commands(cmd)
    assert (op, args[0], int(args[-1])) == (b"HPUB", b"sk.4.g.1._", len(body))
    hlen = int(args[-2])
    msg = nats.Msg(args[0], b"1", None, body[hlen:], body[:hlen])
    assert unpack_run(msg, 1 << 20) == (4, 2**63 - 8, 7, tuple(stamps), frames, b"al%2Eice")


@pytest.mark.parametrize("stamp", [-1.0, -0.0, float("inf"), float("nan"), 1e300, 2.0**49])
def test_a_run_with_a_timestamp_out_of_range_is_refused(stamp):
    frame = encode_frame({"type": "send", "seq": "1"})
    cmd = b"".join(encode_run(b"sk.4.g.1._", 4, 1, 1, pack_stamps([stamp]), [frame],
                              len(frame) + 8))
    [(_op, args, body)] = parse_commands(cmd)
    hlen = int(args[-2])
    with pytest.raises(MalformedError):
        unpack_run(nats.Msg(args[0], b"1", None, body[hlen:], body[:hlen]), 1 << 20)


@pytest.mark.parametrize("origin", [b"1 10000000000000000000 1 1 *", b"1 1 1 0 *",
                                    b"1 1 9223372036854775807 1 *", b"1 1 1 1", b"1 1 1 1 a b",
                                    b"1 1 1 1 %zz", b"-1 1 1 1 *", b"1 1 1 99999999 *"])
def test_bad_run_headers_are_refused(origin):
    msg = nats.Msg(b"sk.1.g.1._", b"1", None, b"\0" * 64, b"NATS/1.0\r\nSkan-Run: " + origin
                   + b"\r\n\r\n")
    with pytest.raises(MalformedError):
        unpack_run(msg, 1 << 20)


def test_a_frame_over_max_frame_is_refused():
    frame = encode_frame({"type": "send", "seq": "1", "msg": b"x" * 1000})
    cmd = b"".join(encode_run(b"sk.4.g.1._", 4, 1, 1, pack_stamps([1.0]), [frame],
                              len(frame) + 8))
    [(_op, args, body)] = parse_commands(cmd)
    hlen = int(args[-2])
    msg = nats.Msg(args[0], b"1", None, body[hlen:], body[:hlen])
    assert unpack_run(msg, 1000 + 100)[4] == [frame]
    with pytest.raises(LimitError):
        unpack_run(msg, 1000)


def test_a_chunk_travels_in_few_runs_and_arrives_in_order():
    routers, bps, fake, pub, sub = pair()
    sent = [send(routers[0], pub, i) for i in range(2000)]
    routers[0].end_batch()
    data = b"".join(bps[0].pending)
    runs = hpubs(data)
    frame_bytes = sum(len(r.frame) + 8 for r in sent)
    largest = max(len(r.frame) + 8 for r in sent)
    # every run but the last as full as RUN_BYTES allows
    assert len(runs) == frame_bytes // (RUN_BYTES - largest) + 1
    assert sum(n for _, n in runs) == 2000 and bps[0].stats.sent == 2000
    fake.pump()
    assert [r.frame for r in sub.got] == [r.frame for r in sent]
    assert [(r.server, r.session, r.instance, r.timestamp) for r in sub.got] == [
        (1, r.session, r.instance, r.timestamp) for r in sent]
    assert bps[1].stats.received == 2000 and bps[1].stats.duplicates == 0


def test_a_mixed_batch_keeps_order_across_subjects():
    routers, bps, fake, pub, sub = pair()
    plan = [("g", "1"), ("g", "1"), ("h", "1"), ("g", "1"), ("g", "2"), ("g", "2")]
    sent = [send(routers[0], pub, i, g, inst) for i, (g, inst) in enumerate(plan)]
    routers[0].end_batch()
    assert hpubs(b"".join(bps[0].pending)) == [
        (b"sk.1.g.1._", 2), (b"sk.1.h.1._", 1), (b"sk.1.g.1._", 1), (b"sk.1.g.2._", 2)]
    fake.pump()
    assert [r.frame for r in sub.got] == [r.frame for r in sent]


def test_both_paths_write_the_same_bytes():
    """A one-run batch takes the one-pass path; the general loop must agree."""
    routers, bps, _fake, pub, _sub = pair(clock_a=iter(range(10**6)).__next__)
    bps[0].take_pending()
    batch = [send(routers[0], pub, i, size=i % 300) for i in range(1500)]
    fast: list[bytes] = []
    general: list[bytes] = []
    assert bps[0]._one_run(batch, b"sk.1.g.1._", fast)
    bps[0]._runs(batch, general, None)
    assert b"".join(fast) == b"".join(general) and len(fast) > 5


def test_a_withheld_one_subject_batch_writes_nothing():
    routers, bps, _fake, pub, _sub = pair()
    bps[0].take_pending()
    for wanted, out in ((set(), False), ({b"h"}, False), ({b"g"}, True), (None, True)):
        bps[0].remote.wanted = wanted
        for i in range(5):
            send(routers[0], pub, i)
        routers[0].end_batch()
        assert bool(bps[0].take_pending()) == out
    assert bps[0].stats.withheld == 10 and bps[0].stats.sent == 10


def test_a_frame_over_max_payload_is_dropped_and_counted():
    routers, bps, fake, pub, sub = pair()
    bps[0].max_payload = 4096
    sent = [send(routers[0], pub, 1), send(routers[0], pub, 2, size=5000),
            send(routers[0], pub, 3)]
    routers[0].end_batch()
    data = b"".join(bps[0].pending)
    assert all(len(body) <= 4096 for _, _, body in parse_commands(data))
    fake.pump()
    assert [r.frame for r in sub.got] == [sent[0].frame, sent[2].frame]
    assert (bps[0].stats.sent, bps[0].stats.drops, bps[0].stats.oversized) == (2, 1, 1)


def test_a_run_received_twice_is_routed_once():
    routers, bps, _fake, pub, sub = pair()
    for i in range(3):
        send(routers[0], pub, i)
    routers[0].end_batch()
    [(_op, args, body)] = parse_commands(bps[0].take_pending())
    hlen = int(args[-2])
    msg = nats.Msg(args[0], b"1", None, body[hlen:], body[:hlen])
    bps[1].receive(msg)
    bps[1].receive(msg)
    routers[1].end_batch()
    assert len(sub.got) == 3
    assert (bps[1].stats.received, bps[1].stats.duplicates) == (3, 3)


def test_nothing_from_nats_goes_back_out():
    routers, bps, fake, pub, sub = pair()
    for i in range(3):
        send(routers[0], pub, i)
    routers[0].end_batch()
    fake.pump()
    assert len(sub.got) == 3 and bps[1].take_pending() == b""


def test_rate_limited_log(caplog):
    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("t"), "bad: %s", 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(5):
            limited(f"r{i}")
        now[0] += 10.0
        limited("later")
    assert [r.getMessage() for r in caplog.records] == [
        "bad: r0", "bad: later (and 4 more in the last 10 s)"]
    assert limited.held_back == 0 and limited.lines == 2


def test_unpack_refuses_what_is_not_a_run():
    frame = encode_frame({"type": "send"})
    block = b"NATS/1.0\r\nSkan-Run: 1 2 3 1 *\r\n\r\n"
    good = struct.pack("<d", 1.0) + frame
    assert unpack_run(nats.Msg(b"s", b"1", None, good, block), 1 << 20)[4] == [frame]
    for headers, payload in [
        (None, good),
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 0 *\r\n\r\n", good),  # count 0
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 -1 *\r\n\r\n", good),
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 *\r\n\r\n", good),
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 1\r\n\r\n", good),  # no user claim
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 2 *\r\n\r\n", good),  # one frame short
        (b"NATS/1.0\r\nSkan-Run: 1 2 3 99999 *\r\n\r\n", good),  # shorter than its stamps
        (block, good + b"\x00"),  # trailing byte
        (block, good[:-1]),
        (block, struct.pack("<d", 1.0) + b"\x00\x00\x00\x01"),  # frame shorter than magic
    ]:
        try:
            unpack_run(nats.Msg(b"s", b"1", None, payload, headers), 1 << 20)
        except MalformedError:
            continue
        raise AssertionError(f"accepted {headers!r} {payload!r}")
