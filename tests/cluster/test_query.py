"""Pure tests of the cluster query merge and its wire form (broker.cluster.cluster_query)."""

from __future__ import annotations

import pytest

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
    assert cq.decode_request(cq.encode_request(params)) == w.QueryTimeseriesParams()
    server = w.QueryServerParams(server_id=2, max_results=1, last_event_id=w.EventId(2, 1, 1))
    assert cq.decode_request(cq.encode_request(server)) == w.QueryServerParams(
        server_id=2, last_event_id=w.EventId(2, 1, 1))


def test_answer_round_trip_and_the_size_bound():
    answer = cq.Gathered(A + B, False)
    assert cq.decode_answer(cq.encode_answer(answer, 1 << 20)) == answer
    data = cq.encode_answer(answer, 300)
    cut = cq.decode_answer(data)
    assert len(data) <= 300 and cut.more_follows and cut.entries == (A + B)[:len(cut.entries)]


@pytest.mark.parametrize("data", [b"", b"\x02", b"\x00" + b"\x01" * 10,
                                  cq.encode_answer(cq.Gathered(A, False), 1 << 20)[:-1]])
def test_malformed_answers_are_refused(data):
    with pytest.raises(MalformedError):
        cq.decode_answer(data)


@pytest.mark.parametrize("data", [b"", b"{}", b'{"query": 5}', b'{"query": ["latest"]}',
                                  b'{"query": ["timeseries", {"order": ["sideways", null]}]}'])
def test_malformed_requests_are_refused(data):
    with pytest.raises(MalformedError):
        cq.decode_request(data)
