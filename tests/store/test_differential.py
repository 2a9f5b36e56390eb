"""The store answers Eventer queries and Mariner replay exactly like the in-memory reference.

For random histories (random types, payload sizes, source timestamps and a
router clock that may stand still or step back), the same routed messages go
to the durable store and to the in-memory ring plus latest table (the code
the broker used before the store, kept as the reference).  Random latest,
timeseries (paged, both orders, both orderings, time windows) and server
queries, and replay reads, must return identical entries.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core import events
from broker.core.retention import RetentionStore
from broker.core.router import Router
from broker.store import Store
from broker.store.retained_query import LatestTable, run_query, run_store_query
from tests.examples import examples
from tests.store.test_store import Clock, Sender
from wire import eventer as w

GROUPS = ["a", "b", "c"]
INSTANCES = ["*", "x", "x/y", "z", "z/y/q"]
PATTERNS = [("*",), ("a", "*"), ("?", "x"), ("a",), ("b", "x", "*"), ("a", "?", "y"), (),
            ("c", "z", "?", "q"), ("?", "*"), ("b", "z")]


message = st.tuples(
    st.sampled_from(GROUPS), st.sampled_from(INSTANCES),
    st.integers(0, 300),  # payload size
    st.one_of(st.none(), st.integers(0, 40)),  # source timestamp offset (s/4)
    st.sampled_from([0.0, 0.0, 1e-7, 0.25, 1.0, 1.5, -0.5]),  # clock step before each
    # The same type this many times in a row: the store keeps such runs in one row.
    st.sampled_from([1, 1, 2, 3, 7]),
)
# Isolated: each message its own routing batch (an independent publisher's
# write), hence its own session: the store keeps runs across sessions.
batch = st.tuples(st.sampled_from([False, False, True]),
                  st.lists(message, min_size=1, max_size=6))
# Mostly unbounded: each bound drawn at random would leave most answers empty.
ts_bound = st.one_of(st.none(), st.none(), st.none(), st.integers(-2, 30).map(lambda q: q / 4))
types = st.one_of(st.none(), st.none(), st.lists(st.sampled_from(PATTERNS), max_size=3))
query = st.one_of(
    st.tuples(st.just("latest"), types),
    st.tuples(st.just("timeseries"), types, ts_bound, ts_bound, ts_bound, ts_bound,
              st.sampled_from(list(w.Order)), st.sampled_from(list(w.OrderBy)),
              st.one_of(st.none(), st.integers(0, 8)),
              # last_event_id: index into the history (mostly one that exists)
              st.one_of(st.none(), st.integers(0, 12), st.integers(0, 40))),
    st.tuples(st.just("server"), st.one_of(st.none(), st.integers(0, 8)),
              st.one_of(st.none(), st.integers(0, 40)), st.sampled_from([0, 1, 2])),
    st.tuples(st.just("replay"), st.one_of(st.none(), st.integers(0, 40)), st.integers(1, 7)),
)
step = st.one_of(batch.map(lambda b: ("batch", b)), query.map(lambda q: ("query", q)))
# A history first (so that queries have something to find), then steps and queries mixed.
steps = st.tuples(st.lists(batch.map(lambda b: ("batch", b)), min_size=2, max_size=8),
                  st.lists(step, min_size=1, max_size=25)).map(lambda t: t[0] + t[1])

BASE = 1_700_000_000.0
SERVER = 1


def _ts(bound):
    return None if bound is None else w.Timestamp.from_float(BASE + bound)


def _types(patterns):
    return None if patterns is None else tuple(tuple(p) for p in patterns)


def _params(q, ids):
    def last(index):
        if index is None or not ids:
            return None
        if index >= len(ids):  # an id that never existed
            return w.EventId(SERVER, ids[-1][0] + 1, 1)
        return w.EventId(SERVER, *ids[index])

    kind = q[0]
    if kind == "latest":
        return w.QueryLatestParams(_types(q[1]))
    if kind == "timeseries":
        _, types, tf, tt, sf, stt, order, order_by, max_results, lei = q
        return w.QueryTimeseriesParams(_types(types), _ts(tf), _ts(tt), _ts(sf), _ts(stt),
                                       order, order_by, max_results, last(lei))
    _, max_results, lei, server = q
    eid = last(lei)
    if eid is not None and server != 1:
        eid = w.EventId(server, eid.session, eid.instance)
    return w.QueryServerParams(SERVER, False, max_results, eid)


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps=steps, size=st.one_of(st.integers(1, 30), st.just(1000)),
       max_bytes=st.sampled_from([0, 600, 2000, 10_000]))
def test_store_answers_like_the_reference(steps, size, max_bytes):
    directory = tempfile.mkdtemp(prefix="skan-store-diff-")
    clock = Clock()
    router = Router(clock=clock)
    store = Store(directory, size=size, max_bytes=max_bytes, max_age=0, flush_interval=0.001)
    try:
        store.attach(router)
        ring = RetentionStore(size, max_bytes)
        ring.attach(router)
        latest = LatestTable(size)
        latest.attach(router)
        sender = Sender()
        router.attach(sender)
        ids: list[tuple[int, int]] = []
        seq = 0
        for kind, item in steps:
            if kind == "batch":
                isolated, messages = item
                for group, instance, nbytes, src, clock_step, repeat in messages:
                    for _ in range(repeat):
                        clock.now += clock_step
                        seq += 1
                        etype = (group,) if instance == "*" else (group, *instance.split("/"))
                        sent = events.send_for_event(
                            etype, events.JsonPayload("p" * (nbytes + seq % 7)),
                            sender=sender.lname, seq=seq,
                            source_timestamp=None if src is None else BASE + src / 4)
                        routed = router.route(sender, sent.frame, sent.header)
                        ids.append((routed.session, routed.instance))
                        if isolated:
                            router.end_batch()
                router.end_batch()
                continue
            if item[0] == "replay":
                _, index, limit = item
                cursor = (0, 0) if index is None or index >= len(ids) else ids[index]
                assert store.entries_after(*cursor, limit) == ring.entries_after(*cursor, limit)
                newest, ref_newest = store.newest(), ring.newest()
                assert (newest is None) == (ref_newest is None)
                if newest is not None:
                    assert (newest.session, newest.instance, newest.frame) == (
                        ref_newest.session, ref_newest.instance, ref_newest.frame)
                assert store.evicted_upto == ring.evicted_upto
                continue
            params = _params(item, ids)
            expected = run_query(params, ring, latest, SERVER)
            got = run_store_query(params, store, SERVER)
            assert got == expected, params
            if isinstance(params, w.QueryServerParams):
                # Every message routed before a query is committed first: the
                # persisted view is the same.
                persisted = w.QueryServerParams(SERVER, True, params.max_results,
                                                params.last_event_id)
                assert run_store_query(persisted, store, SERVER) == expected
        # Page through everything in every order, two events per page, as a
        # client following moreFollows with lastEventId does.
        for order in w.Order:
            for order_by in w.OrderBy:
                # Everything, a group, one type, and types of two groups (the
                # store tests the instance on its group index: Store._wanted_types).
                for types in (None, (("a", "*"),), (("b", "z"),),
                              (("a", "?", "y"), ("c", "*"), ("b", "x"))):
                    last = None
                    for _ in range(100):
                        params = w.QueryTimeseriesParams(types, order=order, order_by=order_by,
                                                         max_results=2, last_event_id=last)
                        expected = run_query(params, ring, latest, SERVER)
                        assert run_store_query(params, store, SERVER) == expected, params
                        if not expected.more_follows:
                            break
                        last = w.EventId(SERVER, *expected.entries[-1][:2])
        store.flush()
        assert store.count == len(ring) and store.evicted == ring.evicted
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
