"""What a broker believes from NATS, the pure parts (issue 27): heartbeats,
peers, user claims, the dedupe window, the from/subject checks and the bounds
on announced interest.  The same attacks against real brokers and a real
nats-server are in test_nats_attacker.py."""

from __future__ import annotations

import struct

import pytest

from broker.cluster import claims, peers
from broker.cluster.backplane import DEDUPE_WINDOW, Backplane
from broker.cluster.interest import WORK_CHUNK, RemoteInterest
from broker.core.auth import Authenticator, Permissions, User
from broker.core.router import NORMAL, Endpoint, Routed, Router
from wire import nats
from wire.errors import MalformedError
from wire.skan import encode_frame


class Recorder(Endpoint):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[bytes] = []

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(frame)


def auth(**kw) -> Authenticator:
    return Authenticator([
        User("alice", None, Permissions("alice", ["*"], ["*"]), None),
        User("spy", None, Permissions("spy", ["public"], ["public"]), None),
    ], **kw)


# ---- heartbeats and peers ---------------------------------------------------------


@pytest.mark.parametrize("payload", [
    b'{"server": 1e999}', b'{"server": 1.5, "boot": "0123456789abcdef"}',
    b'{"server": true, "boot": "0123456789abcdef"}', b'{"server": -1, "boot": "0123456789abcdef"}',
    b'{"server": 9223372036854775808, "boot": "0123456789abcdef"}', b'{"server": 1}',
    b'{"server": 1, "boot": "xyz"}', b"[" * 100_000, b"[1]", b"nope",
    b'{"server": 1, "boot": "0123456789abcdef", "x": "' + b"y" * 600 + b'"}'])
def test_bad_heartbeats_are_malformed(payload):
    with pytest.raises(MalformedError):
        peers.decode_hello(payload)


def test_peers_are_bounded_proved_and_reset_on_restart():
    p = peers.Peers(1, max_peers=3)
    boot = "0123456789abcdef"
    assert [p.heard(s, boot, 0.0, 3.0) for s in (2, 3, 4, 5)] == [
        peers.NEW, peers.NEW, peers.NEW, peers.REFUSED]
    assert p.refused == 1 and p.alive(0.0, 3.0) == []  # heard, not proved alive
    assert p.proved(2, boot) and not p.proved(3, "f" * 16)  # another boot: no
    assert p.alive(0.0, 3.0) == [2]
    assert p.heard(2, "f" * 16, 1.0, 3.0) == peers.RESTARTED and p.alive(1.0, 3.0) == []
    assert p.heard(5, boot, 4.0, 3.0) == peers.NEW  # 3 and 4 forgotten: room again
    # A proved broker forgotten for a late heartbeat is still proved when the
    # same boot is heard again (no new ping needed); a new boot is not.
    assert p.proved(5, boot) and p.alive(4.0, 3.0) == [5]
    p.forget(10.0, 3.0)
    assert p.alive(10.0, 3.0) == []
    assert p.heard(5, boot, 10.0, 3.0) == peers.KNOWN and p.alive(10.0, 3.0) == [5]
    p.missed({5})
    assert p.alive(10.0, 3.0) == []


# ---- user claims ------------------------------------------------------------------


def test_claims_get_this_brokers_permissions():
    a = auth(allow_anonymous=False)
    assert claims.permissions(b"alice", a) is a.users["alice"].permissions
    assert claims.permissions(b"nobody", a) is claims.NOTHING
    assert claims.permissions(b"~", a) is claims.NOTHING
    assert claims.permissions(b"*", a) is None  # a bridge without user
    assert claims.permissions(b"*", a, query=True) is claims.NOTHING  # answered as anonymous
    open_broker = Authenticator()
    assert claims.permissions(b"*", open_broker, query=True) is None
    guest = auth(allow_anonymous=True, anonymous_user="spy")
    assert claims.permissions(b"~", guest) is guest.users["spy"].permissions
    with pytest.raises(MalformedError):
        claims.check(b"a b")


# ---- runs from NATS ---------------------------------------------------------------


def broker2() -> tuple[Router, Backplane, Recorder]:
    router = Router(server_id=2)
    router.enforcer.auth = auth(allow_anonymous=False)
    bp = Backplane(router, 2)
    sub = Recorder()
    router.attach(sub)
    router.subscribe(sub, b"g", b"*", NORMAL)
    router.subscribe(sub, b"public", b"*", NORMAL)
    return router, bp, sub


def run_msg(subject: bytes, server: int, session: int, frames: list[bytes],
            claim: bytes = b"*", first: int = 1) -> nats.Msg:
    block = b"NATS/1.0\r\nSkan-Run: %d %d %d %d %s\r\n\r\n" % (server, session, first,
                                                             len(frames), claim)
    stamps = struct.pack(f"<{len(frames)}d", *([1.7e9] * len(frames)))
    return nats.Msg(subject, b"1", None, stamps + b"".join(frames), block)


def frame(sender: bytes, group: bytes = b"g", msg: bytes = b"m", seq: int = 1) -> bytes:
    return encode_frame({"type": "send", "from": sender, "to": "*", "group": group,
                         "instance": "i", "seq": str(seq), "msg": msg})


def deliver(router: Router, bp: Backplane, msg: nats.Msg) -> None:
    bp.receive(msg)
    router.end_batch()


def test_a_huge_session_cannot_silence_a_broker():
    router, bp, sub = broker2()
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 2**63 - 10, [frame(b"x@h/1")]))
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 10**19, [frame(b"x@h/1")]))  # out of range
    for i in range(5):
        deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 100 + i, [frame(b"x@h/1", seq=i)]))
    assert len(sub.got) == 6 and bp.stats.malformed == 1
    # The second copy of a run (overlapping subscriptions) is dropped ...
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 104, [frame(b"x@h/1", seq=4)]))
    assert len(sub.got) == 6 and bp.stats.duplicates == 1
    # ... and the window is bounded and forgotten when broker 1 restarts.
    for i in range(2 * DEDUPE_WINDOW):
        deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 1000 + i, [frame(b"x@h/1")]))
    assert len(bp._recent[1]) == DEDUPE_WINDOW
    bp.peer_restarted(1, 0.0)
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 104, [frame(b"x@h/1", seq=4)]))
    assert bp.stats.duplicates == 1


@pytest.mark.parametrize("subject, server, sender", [
    (b"sk.1.g.i._", 1, b"x@h/2"),     # a frame of broker 2's client on broker 1's subject
    (b"sk.1.g.i._", 2, b"x@h/2"),     # an origin that is not the subject's broker
    (b"sk.1.g.i._", 1, b"x@h/11"),
    (b"sk.1.g.i._", 1, b"x/1"),       # no host part
    (b"sk.01.g.i._", 1, b"x@h/1"),
    (b"sk.g.i._", 1, b"x@h/1"),       # the old scheme: no publisher
])
def test_a_frame_speaks_only_for_the_broker_of_its_subject(subject, server, sender):
    router, bp, sub = broker2()
    deliver(router, bp, run_msg(subject, server, 5, [frame(sender)]))
    assert sub.got == [] and bp.stats.forged == 1 and bp.stats.received == 0


def test_frame_by_frame_runs_check_every_from():
    router, bp, sub = broker2()
    good = frame(b"y@h/1", b"public")
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 6, [frame(b"x@h/2"), good, frame(b"z@h/3")]))
    assert sub.got == [good] and bp.stats.forged == 2


def test_a_claim_gets_this_brokers_permissions_for_the_user():
    router, bp, sub = broker2()
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 5, [frame(b"x@h/1")], b"spy"))
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 6, [frame(b"x@h/1")], b"nobody"))
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 7, [frame(b"x@h/1")], b"~"))
    assert sub.got == [] and bp.stats.refused == 3
    assert router.counters.permission_denied == {"cluster:publish": 3}
    deliver(router, bp, run_msg(b"sk.1.public.i._", 1, 8, [frame(b"x@h/1", b"public")], b"spy"))
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 9, [frame(b"x@h/1")], b"alice"))
    assert len(sub.got) == 2 and bp.stats.received == 2


def test_an_oversized_frame_is_refused_and_counted():
    router, bp, sub = broker2()
    bp.max_frame = 1000
    deliver(router, bp, run_msg(b"sk.1.g.i._", 1, 5, [frame(b"x@h/1", msg=b"x" * 2000)]))
    assert sub.got == [] and bp.stats.oversized_in == 1 and bp.stats.malformed == 1


# ---- interest ---------------------------------------------------------------------


def full(server: int, seq: int, groups: list[bytes], part: int = 0, parts: int = 1) -> bytes:
    return (b"SKI %d %d full %d %d\n" % (server, seq, part, parts)
            + b"".join(g + b"\n" for g in groups))


def test_interest_is_bounded_and_counted_in_steps():
    remote = RemoteInterest(1, 0.0, 100.0, max_groups=1000)
    remote.reset(0.0)
    groups = [b"g%d" % i for i in range(900)]
    remote.receive(full(2, 1, groups), 1.0, 2)
    assert set(remote.wanted) == set(groups)
    # Over the bound: that broker counts as wanting everything (safe).
    remote.receive(full(3, 1, [b"h%d" % i for i in range(1001)]), 1.0, 3)
    assert remote.wanted is None and remote.refused == 1
    remote.receive(full(3, 2, [b"h"]), 1.0, 3)
    assert set(remote.wanted) == {*groups, b"h"}
    # A large change is counted WORK_CHUNK groups per step; everything is
    # published until it is done.
    big = RemoteInterest(1, 0.0, 100.0)
    big.reset(0.0)
    many = [b"g%d" % i for i in range(3 * WORK_CHUNK)]
    parts = [many[i:i + 10_000] for i in range(0, len(many), 10_000)]
    for i, part in enumerate(parts):
        big.receive(full(2, i + 1, part, i, len(parts)), 1.0, 2)
    assert big.wanted is None and big.busy
    steps = 0
    while big.work():
        steps += 1
    assert steps >= 1 and len(big.wanted) == len(many)
    # A delta is one count.
    big.receive(b"SKI 2 %d + \nnew\n" % (len(parts) + 1), 1.0, 2)
    assert b"new" in big.wanted and not big.busy


def test_interest_must_speak_for_its_subjects_broker():
    remote = RemoteInterest(1, 0.0, 100.0)
    remote.reset(0.0)
    from broker.cluster.interest import ForgedError
    with pytest.raises(ForgedError):
        remote.receive(full(2, 1, [b"g"]), 1.0, 3)
