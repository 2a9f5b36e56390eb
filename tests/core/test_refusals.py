"""Refusals are raised, one family (broker/core/refusals.py), and the enforcer
(broker/core/enforcement.py) is where section 7 is applied: pure, no sockets."""

from __future__ import annotations

import hashlib

import pytest

from broker.core.auth import Authenticator, Permissions, User
from broker.core.enforcement import Enforcer
from broker.core.inject import build_send, route_injected
from broker.core.reasons import ErrorKind
from broker.core.refusals import FrameTooLarge, NotPermitted, Refused, TooManySubscriptions
from broker.core.router import NORMAL, PROMISC, Endpoint, Routed, Router
from broker.core.skan_handler import SkanHandler
from wire.skan import decode_header, encode_frame


class Sink(Endpoint):
    def __init__(self, protocol: str = "skan") -> None:
        super().__init__()
        self.protocol = protocol
        self.got: list[Routed] = []
        self.control: list[dict] = []

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(routed)

    def send_control(self, message: dict) -> None:
        self.control.append(message)


def user(name: str, token: str, publish=(), subscribe=(), promisc=False) -> User:
    return User(name, hashlib.sha256(token.encode()).digest(),
                Permissions(name, publish, subscribe, promisc), None)


def restricted_router(**kwargs) -> Router:
    router = Router(hostname="t", **kwargs)
    router.enforcer.auth = Authenticator(
        [user("s", "t", publish=["telemetry"], subscribe=["cmd", "telemetry"])],
        allow_anonymous=False)
    return router


def send(router: Router, ep: Endpoint, group: str, seq: str = "1") -> bytes:
    return encode_frame({"type": "send", "from": ep.lname, "to": "*", "group": group,
                         "instance": "i", "seq": seq, "msg": None})


def test_every_refusal_is_one_family_with_its_label():
    for cls, kind, denied in ((Refused, ErrorKind.REJECTED, False),
                              (NotPermitted, ErrorKind.NOT_AUTHORISED, True),
                              (TooManySubscriptions, ErrorKind.MAX_SUBSCRIPTIONS, False),
                              (FrameTooLarge, ErrorKind.TOO_LARGE, False)):
        exc = cls("why", close=True)
        assert isinstance(exc, Refused) and exc.kind == kind and exc.denied is denied
        answer = exc.answering(b"7")
        assert type(answer) is cls and answer.seq == b"7" and answer.close
        assert answer.error_message() == {"type": "error", "error": "why", "seq": b"7"}
    assert Refused("why").error_message() == {"type": "error", "error": "why"}


def test_login_refusal_is_raised_counted_and_closes():
    router = restricted_router()
    ep = Sink()
    router.attach(ep)
    with pytest.raises(NotPermitted, match="does not match any user") as info:
        router.enforcer.login(ep, b"wrong")
    assert info.value.close
    assert router.counters.auth_failures == {"skan": 1}
    assert ep.principal is None and ep.publish_allowed is None
    router.enforcer.login(ep, b"t")
    assert ep.principal is not None and ep.perms is not None
    assert ep.publish_allowed is ep.perms.publish_allowed


def test_route_asks_the_enforcer_only_for_a_group_not_yet_known_allowed():
    """The hot path: a known group costs one set test, no call into enforcement."""
    router = restricted_router()
    pub, sub = Sink(), Sink()
    for ep in (pub, sub):
        router.attach(ep)
        router.enforcer.login(ep, b"t")
    router.subscribe(sub, b"telemetry", b"*", NORMAL)
    asked: list[bytes] = []

    class Counting(Enforcer):
        __slots__ = ()

        def check_publish(self, endpoint, group: bytes) -> None:
            asked.append(group)
            super().check_publish(endpoint, group)

    router.enforcer = Counting(router.counters, router.enforcer.auth)
    frame = send(router, pub, "telemetry")
    for _ in range(3):
        router.route(pub, frame, decode_header(frame, 4))
    assert asked == [b"telemetry"] and len(sub.got) == 3
    denied = send(router, pub, "cmd")
    for _ in range(2):
        with pytest.raises(NotPermitted, match="may not send to group 'cmd'"):
            router.route(pub, denied, decode_header(denied, 4))
    # A refused group is asked every time (it never enters the allowed set).
    assert asked == [b"telemetry", b"cmd", b"cmd"]
    assert router.counters.permission_denied == {"skan:publish": 2}
    assert router.counters.msgs_in == 3  # nothing routed for the refused sends


def test_subscription_limit_is_raised_and_counted_nothing_subscribed():
    router = Router(hostname="t", max_subscriptions=2)
    ep = Sink()
    router.attach(ep)
    router.subscribe(ep, b"a", b"*", NORMAL)
    router.subscribe_pattern(ep, (b"b", b"*"))
    # Replacing a subtype or an existing pattern is always allowed.
    router.subscribe(ep, b"a", b"*", PROMISC)
    router.subscribe_pattern(ep, (b"b", b"*"))
    with pytest.raises(TooManySubscriptions, match="already holds 2"):
        router.subscribe(ep, b"c", b"*", NORMAL)
    with pytest.raises(TooManySubscriptions, match="already holds 2"):
        router.subscribe_pattern(ep, (b"c", b"*"))
    with pytest.raises(TooManySubscriptions, match=r"too many subscriptions: 1 \(at most 2"):
        router.check_room(ep, 1)
    router.check_room(ep, 0)
    assert router.subscription_total(ep) == 2
    assert router.counters.subscriptions_refused == 3


def test_skan_handler_raises_refusals_answering_the_seq():
    router = restricted_router(max_subscriptions=1)
    ep = Sink()
    router.attach(ep)
    handler = SkanHandler(router, ep)
    with pytest.raises(Refused, match="first message must be getlname") as info:
        handler.handle(encode_frame({"type": "stats", "seq": "1"}))
    assert info.value.close and type(info.value) is Refused and info.value.seq == b"1"
    with pytest.raises(NotPermitted) as denied:
        handler.handle(encode_frame({"type": "getlname", "seq": "2", "token": "bad"}))
    assert denied.value.close and denied.value.seq == b"2"
    handler.handle(encode_frame({"type": "getlname", "seq": "3", "token": "t"}))
    assert ep.control == [{"lname": ep.lname}]
    cases = [
        ({"type": "subscribe", "seq": "4", "group": "telemetry"}, Refused,
         "needs the field 'instance'"),
        ({"type": "subscribe", "seq": "5", "group": "telemetry", "instance": "*",
          "subtype": "x"}, Refused, "bad subtype"),
        ({"type": "subscribe", "seq": "6", "group": "other", "instance": "*"}, NotPermitted,
         "may not subscribe to group 'other'"),
        ({"type": "send", "seq": "7", "from": ep.lname, "to": "*", "group": "cmd",
          "instance": "i", "msg": None}, NotPermitted, "may not send to group 'cmd'"),
        ({"type": "send", "seq": "8", "from": "someone", "to": "*", "group": "telemetry",
          "instance": "i", "msg": None}, Refused, "'from' is 'someone'"),
        ({"type": "nope", "seq": "9"}, Refused, "unknown message type"),
    ]
    for message, cls, reason in cases:
        with pytest.raises(cls, match=reason) as info:
            handler.handle(encode_frame(message))
        assert type(info.value) is cls and info.value.seq == message["seq"].encode()
        assert not info.value.close
    handler.handle(encode_frame({"type": "subscribe", "seq": "10", "group": "telemetry",
                                 "instance": "*"}))
    with pytest.raises(TooManySubscriptions) as full:
        handler.handle(encode_frame({"type": "subscribe", "seq": "11", "group": "cmd",
                                     "instance": "*"}))
    assert full.value.seq == b"11" and full.value.kind == ErrorKind.MAX_SUBSCRIPTIONS


def test_injected_refusals_are_raised():
    router = restricted_router(max_frame=200)
    ep = Sink("hsp-bridge")
    router.attach(ep)
    router.enforcer.login_bridge(ep, "s")
    with pytest.raises(FrameTooLarge, match="exceeds max_frame"):
        route_injected(router, ep, build_send(ep.lname, b"telemetry", b"i", 1, b"x" * 300))
    assert router.counters.errors == {"hsp-bridge:too-large": 1}
    with pytest.raises(NotPermitted, match="may not send to group 'cmd'"):
        route_injected(router, ep, build_send(ep.lname, b"cmd", b"i", 2, None))
    assert router.counters.permission_denied == {"hsp-bridge:publish": 1}
    assert router.counters.msgs_in == 0


def test_reload_prunes_what_the_new_permissions_refuse():
    router = restricted_router()
    ep = Sink()
    router.attach(ep)
    router.enforcer.login(ep, b"t")
    router.subscribe(ep, b"cmd", b"*", NORMAL)
    router.subscribe(ep, b"telemetry", b"*", NORMAL)
    router.subscribe_pattern(ep, (b"cmd", b"*"))
    narrower = Authenticator([user("s", "t", subscribe=["telemetry"])], allow_anonymous=False)
    assert router.reload_auth(narrower) == []
    assert router.enforcer.auth is narrower
    assert router.subscriptions_of(ep) == [(b"telemetry", b"*", None, NORMAL)]
    assert ep.publish_allowed is not None and not ep.perms.may_publish(b"telemetry")
    assert router.reload_auth(Authenticator([], allow_anonymous=False)) == [ep]


def test_enforcer_may_read():
    enforcer = Enforcer(Router().counters)
    ep = Sink()
    ep.lname = b"me"
    assert enforcer.may_read(ep, b"any", b"other")  # full rights
    ep.perms = Permissions("u", (), ["g"], promisc=False)
    assert enforcer.may_read(ep, b"g", b"*") and enforcer.may_read(ep, b"g", b"me")
    assert not enforcer.may_read(ep, b"g", b"other") and not enforcer.may_read(ep, b"h", b"*")
