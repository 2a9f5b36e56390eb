"""The compiled routing-log formatters (broker/_observer_speedups.c: JSON lines, columns) against
their Python loops."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.router import NORMAL, Router
from broker.observability.routelog import columns, parquet, record
from broker.observability.routelog.columns import ColumnBuffer
from broker.observability.routelog.record import RecordBuffer
from tests.examples import examples
from tests.observability.routelog.test_record import sink
from wire.skan import decode_header, encode_frame

lines_built = pytest.mark.skipif(record._lines_c is None,
                                 reason="broker._observer_speedups not built "
                                 "(or SKAN_PURE_PYTHON=1)")

# DATA values a client may send: plain, empty, JSON-escaped, non-ASCII, not UTF-8.
data = st.sampled_from([b"g", b"", b"a b", b'q"uote', b"back\\slash", "é".encode(),
                        b"\xff\xfe", b"\x01ctl", "日本".encode()])
seq = st.one_of(st.none(), st.sampled_from([b"1", b"0042", b"", b"12a", b"-1", "٣".encode(),
                                            b"\xff"]),
                st.integers(0, 10**25).map(lambda i: str(i).encode()))
message = st.tuples(st.integers(0, 2), data, data, st.booleans(), seq,
                    st.sampled_from([0.0, 1e-6, 0.123456789, 3.0, -2.0]),
                    st.integers(0, 300))


class Clock:
    def __init__(self) -> None:
        self.now = 1_718_000_000.123456

    def __call__(self) -> float:
        return self.now


@lines_built
@settings(max_examples=examples(300), deadline=None)
@given(st.lists(message, min_size=1, max_size=15), st.integers(1, 3))
def test_compiled_lines_equal_the_reference(messages, subscribe_every):
    clock = Clock()
    router = Router(clock=clock)
    senders = [sink(router), sink(router, "hsp"), sink(router, "eventer")]
    sub = sink(router)
    batch = []
    for k, (who, group, instance, directed, sq, step, size) in enumerate(messages):
        if k % subscribe_every == 0:  # recipients change: new tuples, new parts
            router.subscribe(sub, group, b"*", NORMAL)
        clock.now += step
        fields = {"type": "send", "from": senders[who].lname,
                  "to": sub.lname if directed else b"*", "group": group,
                  "instance": instance, "msg": b"x" * size}
        if sq is not None:
            fields["seq"] = sq
        frame = encode_frame(fields)
        batch.append(router.route(senders[who], frame, decode_header(frame, 4)))
    compiled = RecordBuffer(1 << 30, lambda: None, router)
    reference = RecordBuffer(1 << 30, lambda: None, router)
    compiled.observe(batch)
    reference.observe_py(batch)
    assert compiled.take() == reference.lines
    for line in reference.lines:
        json.loads(line)


@lines_built
def test_a_nested_seq_and_a_non_float_timestamp_go_through_python():
    router = Router()
    pub = sink(router)
    frame = encode_frame({"type": "send", "from": pub.lname, "to": "*", "group": "g",
                          "instance": "*", "seq": {"n": "1"}, "msg": b"m"})
    routed = router.route(pub, frame, decode_header(frame, 4))
    routed2 = router.route(pub, frame, decode_header(frame, 4))
    routed2.timestamp = 1718000000  # an int: the C loop stops there
    compiled = RecordBuffer(1 << 30, lambda: None, router)
    reference = RecordBuffer(1 << 30, lambda: None, router)
    compiled.observe([routed, routed2])
    reference.observe_py([routed, routed2])
    assert compiled.lines == reference.lines and '"seq":""' in compiled.lines[0]
    assert record._lines_c([routed, routed2], 0, [], compiled._parts_of, record._seq) == 1


def _batch(messages, subscribe_every):
    clock = Clock()
    router = Router(clock=clock)
    senders = [sink(router), sink(router, "hsp"), sink(router, "eventer")]
    sub = sink(router)
    batch = []
    for k, (who, group, instance, directed, sq, step, size) in enumerate(messages):
        if k % subscribe_every == 0:  # recipients change: new tuples, new parts
            router.subscribe(sub, group, b"*", NORMAL)
        clock.now += step
        fields = {"type": "send", "from": senders[who].lname,
                  "to": sub.lname if directed else b"*", "group": group,
                  "instance": instance, "msg": b"x" * size}
        if sq is not None:
            fields["seq"] = sq
        frame = encode_frame(fields)
        batch.append(router.route(senders[who], frame, decode_header(frame, 4)))
    return router, batch


@pytest.mark.skipif(columns._columns_c is None, reason="broker._observer_speedups not built")
@settings(max_examples=examples(300), deadline=None)
@given(st.lists(message, min_size=1, max_size=15), st.integers(1, 3))
def test_compiled_columns_equal_the_reference_and_the_json_lines(messages, subscribe_every):
    """routelog_columns appends exactly what ColumnBuffer.observe_py does, and the table
    the writer makes of it equals the JSON Lines records of the same messages."""
    router, batch = _batch(messages, subscribe_every)
    compiled = ColumnBuffer(1 << 30, lambda: None, router)
    reference = ColumnBuffer(1 << 30, lambda: None, router)
    compiled.observe(batch)
    reference.observe_py(batch)
    got, want = compiled.take(), reference.take()
    assert got.rows == want.rows == len(batch)
    assert (got.times, got.sizes, got.keys, got.seq_ends, got.seq_data, got.new_parts) == (
        want.times, want.sizes, want.keys, want.seq_ends, want.seq_data, want.new_parts)
    table = parquet.columns_to_table([got]).to_pylist()
    lines = [json.loads(line) for line in record.format_records(batch).splitlines()]
    for row in table:
        row["recipients"] = dict(row["recipients"])
    assert table == lines


def test_columns_of_a_nested_seq_and_a_non_float_timestamp_go_through_python():
    router = Router()
    pub = sink(router)
    frame = encode_frame({"type": "send", "from": pub.lname, "to": "*", "group": "g",
                          "instance": "*", "seq": {"n": "1"}, "msg": b"m"})
    routed = router.route(pub, frame, decode_header(frame, 4))
    routed2 = router.route(pub, frame, decode_header(frame, 4))
    routed2.timestamp = 1718000000  # an int: the C loop stops there
    buf = ColumnBuffer(1 << 30, lambda: None, router)
    buf.observe([routed, routed2])
    got = buf.take()
    rows = parquet.columns_to_table([got]).to_pylist()
    assert [r["seq"] for r in rows] == ["", ""]
    assert rows[1]["time_us"] == 1718000000 * 1_000_000
    if columns._columns_c is not None:
        fresh = ColumnBuffer(1 << 30, lambda: None, router)
        assert columns._columns_c([routed, routed2], 0, fresh._cols, fresh._parts_of,
                                  columns.seq_value) == 1
