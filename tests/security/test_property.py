"""Property (pure, against the routing core): a user never receives a message on a
group outside its subscribe permissions, whatever the mix of subscriptions and sends
(normal, meonly, promisc, Hat patterns, directed, replies) and permission reloads."""

from __future__ import annotations

import contextlib
import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.auth import Authenticator, Permissions, User
from broker.core.refusals import NotPermitted
from broker.core.router import MEONLY, NORMAL, PROMISC, Router
from tests.examples import examples
from tests.security.common import Sink
from wire.skan import decode_header, encode_frame

GROUPS = ["a", "a.x", "a.y", "b", "c"]
PATTERNS = ["a", "a.*", "b", "*", "c", "x*"]
INSTANCES = ["*", "i", "j/k"]
N_USERS = 3
N_CONNS = 5

perm_lists = st.lists(st.sampled_from(PATTERNS), max_size=3)
user_perms = st.tuples(perm_lists, perm_lists, st.booleans())

op = st.one_of(
    st.tuples(st.just("sub"), st.integers(0, N_CONNS - 1), st.sampled_from(GROUPS),
              st.sampled_from(INSTANCES), st.sampled_from([NORMAL, MEONLY, PROMISC])),
    st.tuples(st.just("pattern"), st.integers(0, N_CONNS - 1),
              st.sampled_from([("a", "*"), ("?",), ("b",), ("*",), ("c", "?"), ("a.x", "*")])),
    st.tuples(st.just("unsub"), st.integers(0, N_CONNS - 1), st.sampled_from(GROUPS),
              st.sampled_from(INSTANCES)),
    st.tuples(st.just("send"), st.integers(0, N_CONNS - 1), st.sampled_from(GROUPS),
              st.sampled_from(INSTANCES), st.one_of(st.none(), st.integers(0, N_CONNS - 1)),
              st.booleans()),
    st.tuples(st.just("reload"), st.lists(user_perms, min_size=N_USERS, max_size=N_USERS)),
)


def make_auth(perms: list[tuple[list[str], list[str], bool]]) -> Authenticator:
    users = [
        User(f"u{i}", hashlib.sha256(f"t{i}".encode()).digest(),
             Permissions(f"u{i}", pub, sub, promisc), None)
        for i, (pub, sub, promisc) in enumerate(perms)
    ]
    return Authenticator(users, allow_anonymous=False)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(user_perms, min_size=N_USERS, max_size=N_USERS), st.lists(op, max_size=60))
def test_no_delivery_outside_subscribe_permissions(initial, ops):
    router = Router(hostname="prop")
    router.enforcer.auth = make_auth(initial)
    conns = [Sink() for _ in range(N_CONNS)]
    for i, ep in enumerate(conns):
        router.attach(ep)
        router.enforcer.login(ep, f"t{i % N_USERS}".encode())
    seq = 0
    for step in ops:
        kind = step[0]
        if kind == "sub":
            _, c, group, instance, subtype = step
            try:
                router.subscribe(conns[c], group.encode(), instance.encode(), subtype)
            except NotPermitted:
                perms = conns[c].perms
                assert perms is not None
                assert not perms.may_subscribe(group.encode()) or (
                    subtype == PROMISC and not perms.promisc)
        elif kind == "pattern":
            _, c, pattern = step
            with contextlib.suppress(NotPermitted):
                router.subscribe_pattern(conns[c], tuple(s.encode() for s in pattern))
        elif kind == "unsub":
            _, c, group, instance = step
            router.unsubscribe(conns[c], group.encode(), instance.encode())
        elif kind == "send":
            _, c, group, instance, to, reply = step
            seq += 1
            sender = conns[c]
            message = {"type": "send", "group": group, "instance": instance,
                       "to": "*" if to is None else conns[to].lname, "from": sender.lname,
                       "seq": str(seq)}
            if reply:
                message["repl"] = "1"
            message["msg"] = None
            frame = encode_frame(message)
            before = [len(ep.got) for ep in conns]
            try:
                router.route(sender, frame, decode_header(frame, 4))
            except NotPermitted:
                assert sender.perms is not None and not sender.perms.may_publish(group.encode())
                assert [len(ep.got) for ep in conns] == before  # nothing routed
                continue
            assert sender.perms is None or sender.perms.may_publish(group.encode())
            router.end_batch()
            # The property, checked against each recipient's permissions right now.
            for ep, n in zip(conns, before, strict=True):
                for routed in ep.got[n:]:
                    assert ep.perms is not None
                    assert ep.perms.may_subscribe(routed.header[b"group"]), (
                        ep.perms, routed.header)
        else:
            router.reload_auth(make_auth(step[1]))
            # Every remaining subscription is permitted after the reload.
            for ep in conns:
                perms = ep.perms
                assert perms is not None
                for group, instance in router.index._owned.get(ep, ()):
                    subtype = router.index._subs[group][instance][ep]
                    assert perms.subscribe_problem(group, subtype == PROMISC) is None
                for pattern, subtype in router.index._patterns.get(ep, {}).items():
                    assert perms.pattern_problem(pattern, subtype == PROMISC) is None
