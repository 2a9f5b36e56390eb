"""Pure tests of the cluster query merge and its wire form (broker.cluster.cluster_query)."""

from __future__ import annotations

import pytest

from broker.cluster import claims
from broker.cluster import cluster_query as cq
from wire import eventer as w
from wire.errors import MalformedError
from wire.skan import encode_frame


def entry(server: int, session: int, instance: int, ts: float, group: str = "g",
          name: str = "i") -> tuple:
    frame = encode_frame({"type": "send", "from": "x", "to": "*", "group": group,
                          "instance": name, "seq": "1", "msg": "m"})
    return (session, instance, ts, frame, 1, group.encode(), name.encode(), server)


def ids(answer: cq.Gathered) -> list[tuple[int, int, int]]:
    return [(e[cq.SERVER], e[0], e[1]) for e in answer.entries]


A = [entry(1, 10, 1, 1.0), entry(1, 10, 2, 3.0), entry(1, 11, 1, 5.0)]
B = [entry(2, 70, 1, 2.0), entry(2, 70, 2, 4.0)]


def test_timeseries_merges_in_time_order_and_drops_duplicates():
    params = w.QueryTimeseriesParams(order=w.Order.ASCENDING)
    merged = cq.merge(params, [cq.Gathered(A, False), cq.Gathered(B + A[:1], False)])
    assert ids(merged) == [(1, 10, 1), (2, 70, 1), (1, 10, 2), (2, 70, 2), (1, 11, 1)]
    assert not merged.more_follows


def test_timeseries_pages_after_a_sentinel_of_any_broker():
    answers = [cq.Gathered(A, False), cq.Gathered(B, False)]
    first = cq.merge(w.QueryTimeseriesParams(max_results=2), answers)
    assert ids(first) == [(1, 11, 1), (2, 70, 2)] and first.more_follows
    last = w.EventId(2, 70, 2)
    second = cq.merge(w.QueryTimeseriesParams(max_results=2, last_event_id=last), answers)
    assert ids(second) == [(1, 10, 2), (2, 70, 1)] and second.more_follows
    gone = cq.merge(w.QueryTimeseriesParams(last_event_id=w.EventId(3, 1, 1)), answers)
    assert gone.entries == []


def test_a_broker_that_had_more_sets_more_follows():
    merged = cq.merge(w.QueryTimeseriesParams(), [cq.Gathered(A, True), cq.Gathered(B, False)])
    assert merged.more_follows and len(merged.entries) == 5


def test_latest_keeps_the_newest_of_each_type_across_brokers():
    a = [entry(1, 10, 1, 1.0, "g", "x"), entry(1, 10, 2, 9.0, "g", "y")]
    b = [entry(2, 70, 1, 5.0, "g", "x"), entry(2, 70, 2, 2.0, "g", "y")]
    merged = cq.merge(w.QueryLatestParams(), [cq.Gathered(a, False), cq.Gathered(b, False)])
    assert ids(merged) == [(2, 70, 1), (1, 10, 2)]


def test_remote_params_leave_paging_to_the_merge():
    params = w.QueryTimeseriesParams(max_results=3, last_event_id=w.EventId(1, 2, 3))
    assert cq.decode_request(cq.encode_request(params)).params == w.QueryTimeseriesParams()
    server = w.QueryServerParams(server_id=2, max_results=1, last_event_id=w.EventId(2, 1, 1))
    assert cq.decode_request(cq.encode_request(server)).params == w.QueryServerParams(
        server_id=2, last_event_id=w.EventId(2, 1, 1))


def test_a_request_carries_the_asking_user_and_lname():
    request = cq.decode_request(cq.encode_request(w.QueryLatestParams(), b"al%2Eice",
                                                  b"5f_1@h/1"))
    assert (request.claim, request.lname) == (b"al%2Eice", b"5f_1@h/1")
    # No claim at all: anonymous (the answering broker gives what it gives anonymous).
    bare = b'{"query": ["latest", {"eventTypes": ["none", null]}]}'
    assert cq.decode_request(bare).claim == claims.ANONYMOUS


def test_answer_round_trip_and_the_size_bound():
    answer = cq.Gathered(A + B, False)
    assert cq.decode_answer(cq.encode_answer(cq.Gathered(A, False), 1 << 20, 1)) == (
        1, cq.Gathered(A, False))
    answer = cq.Gathered(B, False)
    data = cq.encode_answer(answer, 150, 2)
    server, cut = cq.decode_answer(data)
    assert server == 2
    assert len(data) <= 150 and cut.more_follows and cut.entries == B[:len(cut.entries)]


@pytest.mark.parametrize("data", [
    b"", b"\x02", b"\x00" + b"\x01" * 10,
    cq.encode_answer(cq.Gathered(A, False), 1 << 20, 1)[:-1],
    # broker 2 answering with an event of broker 1: refused
    cq.encode_answer(cq.Gathered(A, False), 1 << 20, 2),
])
def test_malformed_answers_are_refused(data):
    with pytest.raises(MalformedError):
        cq.decode_answer(data)


@pytest.mark.parametrize("data", [
    b"", b"{}", b'{"query": 5}', b'{"query": ["latest"]}', b"[1e999]", b"[" * 100_000,
    b'{"query": ["timeseries", {"order": ["sideways", null]}]}',
    b'{"query": ["latest", {}], "user": 5}', b'{"query": ["latest", {}], "user": "a b"}',
    b'{"query": ["latest", {}], "lname": "' + b"x" * 1000 + b'"}',
    b'{"query": ["timeseries", {"tFrom": [1e999, 0]}]}',
    b"x" * (cq.MAX_REQUEST + 1)])
def test_malformed_requests_are_refused(data):
    with pytest.raises(MalformedError):
        cq.decode_request(data)
