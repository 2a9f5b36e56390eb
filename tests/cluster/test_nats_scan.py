"""The NATS codec's fast path (message lines as nats-server writes them) against
its measured path: the same stream with lower-case operation names is parsed
only by the measured path, and both must give the same events, however the
stream is cut."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from wire import nats

token = st.binary(min_size=1, max_size=12).map(
    lambda b: bytes(33 + c % 94 for c in b))  # printable, no white space
messages = st.lists(st.tuples(
    token, token, st.none() | token, st.binary(max_size=300),
    st.none() | st.binary(max_size=40).map(lambda h: b"NATS/1.0\r\n" + h)), max_size=8)


def encode(msgs, op_case=bytes.upper) -> bytes:
    out = []
    for subject, sid, reply, payload, headers in msgs:
        r = b" " + reply if reply else b""
        if headers is None:
            out.append(op_case(b"MSG") + b" %s %s%s %d\r\n%s\r\n"
                       % (subject, sid, r, len(payload), payload))
        else:
            out.append(op_case(b"HMSG") + b" %s %s%s %d %d\r\n%s%s\r\n"
                       % (subject, sid, r, len(headers), len(headers) + len(payload),
                          headers, payload))
        out.append(b"PING\r\n")
    return b"".join(out)


def events(stream: bytes, cuts: list[int]) -> list[nats.Event]:
    conn = nats.NatsConnection()
    got: list[nats.Event] = []
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    for a, b in itertools.pairwise(bounds):
        got += conn.receive_data(stream[a:b])
    return got


@settings(max_examples=examples(300), deadline=None)
@given(messages, st.lists(st.integers(0, 10**6), max_size=6))
def test_fast_path_agrees_with_measured_path(msgs, cuts):
    fast = events(encode(msgs), cuts)
    measured = events(encode(msgs, bytes.lower), [])
    assert fast == measured
    expected = []
    for subject, sid, reply, payload, headers in msgs:
        expected += [nats.Msg(subject, sid, reply or None, payload, headers), nats.Ping()]
    assert fast == expected


def test_a_message_over_max_payload_is_refused_on_the_fast_path_too():
    conn = nats.NatsConnection()
    conn.receive_data(b'INFO {"max_payload":10}\r\n')
    try:
        conn.receive_data(b"HMSG s 1 10 11\r\nNATS/1.0\r\n\r\nx\r\n")
    except nats.NatsError as exc:
        assert "out of bounds" in str(exc)
    else:
        raise AssertionError("accepted a message over max_payload")
