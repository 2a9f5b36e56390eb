"""The send rules of BROKER-SPEC section 1, one test per rule, on the pure router."""

from __future__ import annotations

import pytest

from broker.core.router import MEONLY, NORMAL, PROMISC, Endpoint, Routed, Router, matches
from wire.skan import decode_header, encode_frame


class Sink(Endpoint):
    def __init__(self, protocol: str = "skan", batched: bool = False) -> None:
        super().__init__()
        self.protocol = protocol
        self.batched = batched
        self.got: list[bytes] = []
        self.flushes = 0

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(frame)

    def flush(self) -> None:
        self.flushes += 1


@pytest.fixture
def router() -> Router:
    return Router(hostname="test")


def make(router: Router, n: int) -> list[Sink]:
    sinks = [Sink() for _ in range(n)]
    for s in sinks:
        router.attach(s)
    return sinks


def send(router: Router, sender: Endpoint, group="g", instance="*", to="*", **extra) -> Routed:
    frame = encode_frame({
        "type": "send", "from": sender.lname, "to": to if isinstance(to, bytes) else to.encode(),
        "group": group, "instance": instance, "seq": "1", **extra, "msg": None,
    })
    return router.route(sender, frame, decode_header(frame, 4))


def test_lnames_unique_in_msgq_format(router):
    a, b = make(router, 2)
    assert a.lname != b.lname
    host = a.lname.split(b"@")[1]
    assert host == b"test"
    t, c = a.lname.split(b"@")[0].split(b"_")
    int(t, 16), int(c, 16)  # both hex
    # Section 7: the counter is followed by 16 hex digits of randomness.
    assert len(c) >= 17
    assert a.lname.split(b"_")[1][-16 - len(b"@test"):-len(b"@test")] != \
        b.lname.split(b"_")[1][-16 - len(b"@test"):-len(b"@test")]
    router.detach(a)
    (c,) = make(router, 1)
    assert c.lname not in (a.lname, b.lname)


def test_broadcast_reaches_normal_and_promisc_not_meonly(router):
    s, n, m, p = make(router, 4)
    router.subscribe(n, b"g", b"*", NORMAL)
    router.subscribe(m, b"g", b"*", MEONLY)
    router.subscribe(p, b"g", b"*", PROMISC)
    r = send(router, s)
    assert (len(n.got), len(m.got), len(p.got)) == (1, 0, 1)
    assert r.delivered == 2


def test_sender_never_gets_its_own_message(router):
    s, n = make(router, 2)
    router.subscribe(s, b"g", b"*", NORMAL)
    router.subscribe(n, b"g", b"*", NORMAL)
    send(router, s)
    assert s.got == [] and len(n.got) == 1


def test_one_copy_per_connection_even_with_overlapping_subscriptions(router):
    s, n = make(router, 2)
    router.subscribe(n, b"g", b"*", NORMAL)
    router.subscribe(n, b"g", b"i", NORMAL)
    send(router, s, instance="i")
    assert len(n.got) == 1


def test_instance_filter(router):
    s, a, b, star = make(router, 4)
    router.subscribe(a, b"g", b"a", NORMAL)
    router.subscribe(b, b"g", b"b", NORMAL)
    router.subscribe(star, b"g", b"*", NORMAL)
    send(router, s, instance="a")
    assert (len(a.got), len(b.got), len(star.got)) == (1, 0, 1)


def test_instance_star_message_reaches_every_instance(router):
    s, a, b = make(router, 3)
    router.subscribe(a, b"g", b"a", NORMAL)
    router.subscribe(b, b"g", b"b", PROMISC)
    send(router, s, instance="*")
    assert (len(a.got), len(b.got)) == (1, 1)


def test_other_group_not_reached(router):
    s, n = make(router, 2)
    router.subscribe(n, b"h", b"*", NORMAL)
    r = send(router, s)
    assert n.got == [] and r.delivered == 0
    assert router.counters.undeliverable == 1


def test_directed_needs_normal_or_meonly_subscription(router):
    s, n, m, none = make(router, 4)
    router.subscribe(n, b"g", b"*", NORMAL)
    router.subscribe(m, b"g", b"i", MEONLY)
    for target in (n, m, none):
        send(router, s, instance="i", to=target.lname)
    assert (len(n.got), len(m.got), len(none.got)) == (1, 1, 0)


def test_directed_meonly_instance_must_match(router):
    s, m = make(router, 2)
    router.subscribe(m, b"g", b"i", MEONLY)
    send(router, s, instance="other", to=m.lname)
    assert m.got == []


def test_directed_does_not_reach_other_normal_subscribers(router):
    s, target, bystander = make(router, 3)
    router.subscribe(target, b"g", b"*", NORMAL)
    router.subscribe(bystander, b"g", b"*", NORMAL)
    send(router, s, to=target.lname)
    assert len(target.got) == 1 and bystander.got == []


def test_meonly_does_not_get_broadcasts(router):
    s, m = make(router, 2)
    router.subscribe(m, b"g", b"*", MEONLY)
    send(router, s)
    assert m.got == []


@pytest.mark.parametrize("tag", ["repl", "reply"])
def test_reply_reaches_target_without_subscription(router, tag):
    s, requester = make(router, 2)
    send(router, s, to=requester.lname, **{tag: "7"})
    assert len(requester.got) == 1


def test_promisc_sees_directed_messages_subject_to_instance(router):
    s, target, p_all, p_i, p_other = make(router, 5)
    router.subscribe(target, b"g", b"*", NORMAL)
    router.subscribe(p_all, b"g", b"*", PROMISC)
    router.subscribe(p_i, b"g", b"i", PROMISC)
    router.subscribe(p_other, b"g", b"x", PROMISC)
    send(router, s, instance="i", to=target.lname)
    assert [len(x.got) for x in (target, p_all, p_i, p_other)] == [1, 1, 1, 0]


def test_promisc_does_not_make_directed_target_eligible(router):
    s, p = make(router, 2)
    router.subscribe(p, b"h", b"*", PROMISC)
    router.subscribe(p, b"g", b"*", PROMISC)
    # a promisc sub alone still sees it (as promisc), exactly once
    send(router, s, to=p.lname)
    assert len(p.got) == 1


def test_resubscribe_replaces_subtype(router):
    s, n = make(router, 2)
    router.subscribe(n, b"g", b"*", NORMAL)
    router.subscribe(n, b"g", b"*", MEONLY)
    assert router.subscription_count == 1
    send(router, s)
    assert n.got == []


def test_unsubscribe_and_noop_unsubscribe(router):
    s, n = make(router, 2)
    router.unsubscribe(n, b"g", b"*")  # absent: no-op
    router.subscribe(n, b"g", b"*", NORMAL)
    send(router, s)
    router.unsubscribe(n, b"g", b"*")
    send(router, s)
    assert len(n.got) == 1
    assert router.subscription_count == 0 and router.group_count == 0


def test_detach_removes_all_subscriptions_and_invalidates_cache(router):
    s, n = make(router, 2)
    router.subscribe(n, b"g", b"*", NORMAL)
    router.subscribe(n, b"h", b"x", NORMAL)
    send(router, s)
    router.detach(n)
    assert router.subscription_count == 0 and router.group_count == 0
    r = send(router, s)
    assert r.delivered == 0 and len(n.got) == 1
    router.detach(n)  # idempotent


def test_cache_invalidated_by_subscription_change(router):
    s, a, b = make(router, 3)
    router.subscribe(a, b"g", b"*", NORMAL)
    send(router, s)
    gen = router.generation
    router.subscribe(b, b"g", b"*", NORMAL)
    assert router.generation > gen
    send(router, s)
    assert (len(a.got), len(b.got)) == (2, 1)


def test_same_frame_object_to_every_recipient(router):
    s, *subs = make(router, 4)
    for x in subs:
        router.subscribe(x, b"g", b"*", NORMAL)
    send(router, s)
    assert all(x.got[0] is subs[0].got[0] for x in subs)


def test_sessions_per_batch_and_instances_within(router):
    s, n = make(router, 2)
    router.subscribe(n, b"g", b"*", NORMAL)
    r1, r2 = send(router, s), send(router, s)
    router.end_batch()
    r3 = send(router, s)
    assert r1.session == r2.session < r3.session
    assert (r1.instance, r2.instance, r3.instance) == (1, 2, 1)


def test_batched_endpoints_flushed_once_per_batch(router):
    (s,) = make(router, 1)
    b = Sink(batched=True)
    router.attach(b)
    router.subscribe(b, b"g", b"*", NORMAL)
    send(router, s)
    send(router, s)
    router.end_batch()
    router.end_batch()
    assert b.flushes == 1 and len(b.got) == 2


def test_observers_see_each_batch_once_in_order(router):
    batches = []
    router.observers.append(batches.append)
    (s,) = make(router, 1)
    first = send(router, s)
    assert batches == []  # handed over at the end of the batch, not per message
    second = send(router, s)
    router.end_batch()
    assert batches == [[first, second]] and first.delivered == 0
    router.end_batch()  # an empty batch is not handed over
    third = send(router, s)
    router.hand_over()  # a reader asks mid-batch: what was routed so far
    fourth = send(router, s)
    router.end_batch()
    assert batches[1:] == [[third], [fourth]]
    assert (third.session, third.instance + 1) == (fourth.session, fourth.instance)


def test_local_observers_skip_what_a_backplane_brought(router):
    every, local = [], []
    router.observers.append(every.append)
    router.local_observers.append(local.append)
    (s,) = make(router, 1)
    mine = send(router, s)
    frame = mine.frame
    theirs = router.route(s, frame, decode_header(frame, 4), origin=(5, 77, 3, 1.5))
    router.end_batch()
    assert every == [[mine, theirs]] and local == [[mine]]
    router.route(s, frame, decode_header(frame, 4), origin=(5, 77, 4, 1.5))
    router.end_batch()
    assert len(every) == 2 and len(local) == 1  # nothing local: no call


def test_stats_counters(router):
    s, n = make(router, 2)
    router.subscribe(n, b"g", b"*", NORMAL)
    r = send(router, s)
    send(router, s, group="nobody")
    st = router.stats()
    assert st["messages_in"] == 2 and st["messages_out"] == 1
    assert st["bytes_out"] == len(r.frame) and st["undeliverable"] == 1
    assert st["connections"] == {"skan": 2} and st["groups"] == 1 and st["subscriptions"] == 1


@pytest.mark.parametrize(
    ("pattern", "etype", "expected"),
    [
        ((b"g", b"*"), (b"g",), True),
        ((b"g", b"*"), (b"g", b"a", b"b"), True),
        ((b"*",), (b"x", b"y"), True),
        ((b"g", b"?"), (b"g", b"a"), True),
        ((b"g", b"?"), (b"g",), False),
        ((b"g", b"?"), (b"g", b"a", b"b"), False),
        ((b"g", b"a"), (b"g", b"a"), True),
        ((b"g", b"a"), (b"g", b"b"), False),
        ((b"g",), (b"g", b"a"), False),
        ((b"?", b"a", b"*"), (b"g", b"a"), True),
    ],
)
def test_hat_pattern_matching(pattern, etype, expected):
    assert matches(pattern, etype) is expected


def test_pattern_subscriptions(router):
    s, ev, ev2, ev3 = make(router, 4)
    router.subscribe_pattern(ev, (b"g", b"*"))
    router.subscribe_pattern(ev2, (b"g", b"a", b"?"))
    router.subscribe_pattern(ev3, (b"*",), PROMISC)
    send(router, s, instance="a/b")
    send(router, s, instance="*")
    assert (len(ev.got), len(ev2.got), len(ev3.got)) == (2, 1, 2)
    # directed to someone else: only the promisc pattern subscriber sees it
    send(router, s, instance="a/b", to=s.lname)
    assert (len(ev.got), len(ev2.got), len(ev3.got)) == (2, 1, 3)
    router.unsubscribe_pattern(ev, (b"g", b"*"))
    send(router, s, instance="a/b")
    assert len(ev.got) == 2 and router.subscription_count == 2


def test_new_session_and_deliver_own_as_hat_event_server(router):
    """Section 11: an Eventer register request is a session of its own, and a
    sender whose Hat subscriptions take what it registered gets it too (a Skan
    send never reaches its sender: route() alone still skips it)."""
    hat = Sink("eventer", batched=True)
    other = Sink("eventer", batched=True)
    router.attach(hat)
    router.attach(other)
    router.subscribe_pattern(hat, (b"g", b"*"))
    router.subscribe_pattern(other, (b"g", b"*"))
    router.new_session()  # nothing open: nothing to end
    first = send(router, hat, instance="a")
    assert hat.got == [] and len(other.got) == 1 and first.delivered == 1
    router.deliver_own(hat, [first])
    assert len(hat.got) == 1 and first.delivered == 2
    assert router.counters.msgs_out == 2
    router.new_session()  # ends the batch: flushed, the next send opens a new session
    assert hat.flushes == 1 and other.flushes == 1
    second = send(router, hat, instance="b")
    assert second.session == first.session + 1 and second.instance == 1
    # Not subscribed to what it sends: nothing of its own.
    lone = Sink("eventer", batched=True)
    router.attach(lone)
    third = send(router, lone, group="h")
    router.deliver_own(lone, [third])
    assert lone.got == [] and third.delivered == 0 and router.counters.undeliverable == 1
