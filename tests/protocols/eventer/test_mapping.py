"""The Eventer hot-path encoder equals the reference mapping, byte for byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.events import event_from_routed
from broker.core.router import Routed
from broker.protocols.eventer.mapping import encode_routed, fast_encode_routed
from tests.examples import examples
from wire.chatter import sbs
from wire.eventer import messages as m
from wire.skan import decode_header, encode_frame

names = st.binary(min_size=1, max_size=12).filter(lambda b: b != b"*") | st.just(b"a/b/c")
leaves = st.binary(max_size=40) | st.text(max_size=20).map(str.encode) | st.none()
msgs = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.binary(min_size=1, max_size=8), inner, max_size=3), max_leaves=6)
tags = st.fixed_dictionaries({}, optional={
    "payload-type": st.text(max_size=8).map(str.encode),
    "payload-json": st.sampled_from([b"true", b"{\"a\":1,\"b\":[1.5,null]}", b"null", b"2",
                                     b"{bad", b"\xff"]),
    "source-timestamp": st.sampled_from([b"12.5", b"-0.25", b"1700000000.123456", b"nan",
                                         b"bogus"]),
})


@settings(max_examples=examples(400))
@given(group=names, instance=names | st.just(b"*"), msg=msgs, extra=tags,
       session=st.integers(0, 2**62), instance_no=st.integers(1, 2**20),
       timestamp=st.floats(0, 4e9), server=st.integers(0, 2**31))
def test_fast_encoder_equals_reference(group, instance, msg, extra, session, instance_no,
                                       timestamp, server):
    frame = encode_frame({"type": "send", "from": b"x_1@h", "to": "*", "group": group,
                          "instance": instance, "seq": "1", "msg": msg, **extra})
    routed = Routed(frame, decode_header(frame, 4), None, (), 1, session, instance_no,
                    timestamp)
    fast = fast_encode_routed(routed, server)
    assert fast == encode_routed(routed, server)
    # and it is a valid HatEventer.Event carrying the mapped event
    decoded = m.event_from_sbs(sbs.decode("HatEventer.Event", fast))
    assert decoded == event_from_routed(routed, server)


def test_fast_encoder_with_payload_json_on_every_msg_shape():
    # a JSON null payload is NULL in msg plus the tag: not "no payload"
    for msg in (None, b"1", {b"a": b"1"}, [b"x"]):
        for tag in (b"null", b"1", b'{"a":1}', b"{bad"):
            frame = encode_frame({"type": "send", "from": b"x_1@h", "to": "*", "group": b"g",
                                  "instance": b"*", "seq": "1", "payload-json": tag,
                                  "msg": msg})
            routed = Routed(frame, decode_header(frame, 4), None, (), 1, 5, 1, 1.5)
            assert fast_encode_routed(routed, 1) == encode_routed(routed, 1)
            decoded = m.event_from_sbs(sbs.decode("HatEventer.Event",
                                                  fast_encode_routed(routed, 1)))
            assert decoded == event_from_routed(routed, 1)
            if tag == b"null":
                assert decoded.payload is not None and decoded.payload.data is None
