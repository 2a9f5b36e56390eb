"""Cluster-wide Mariner replay pages through every broker's events, with no cap:
three brokers' stores, more events than one answer carries (QUERY_LIMIT), equal
and interleaved timestamps, answers cut short by NATS's max_payload."""

from __future__ import annotations

from broker.cluster import cluster_query as cq
from broker.core.retention import RetentionStore
from broker.core.router import Endpoint, Routed, Router
from broker.store.retained_query import QUERY_LIMIT
from wire.skan import decode_header, encode_frame

PATTERNS = (("g", "*"),)


class Pub(Endpoint):
    def deliver(self, frame: bytes, routed: Routed) -> None:  # pragma: no cover - no subs
        pass


def broker(server_id: int, times: list[float], groups: list[str]) -> RetentionStore:
    """A store holding one message per timestamp (group by position)."""
    now = [1.0]
    router = Router(server_id=server_id, clock=lambda: now[0])
    store = RetentionStore(len(times) + 1)
    store.attach(router)
    pub = Pub()
    router.attach(pub)
    for i, group in enumerate(groups):
        now[0] = times[i]
        frame = encode_frame({"type": "send", "group": group, "instance": str(i), "to": "*",
                              "from": pub.lname, "seq": str(i), "msg": b"m"})
        router.route(pub, frame, decode_header(frame, 4))
        if i % 100 == 99:
            router.end_batch()
    router.end_batch()
    return store


def replay(stores: dict[int, RetentionStore], start: tuple[float, int, int, int],
           max_bytes: int = 1 << 30) -> tuple[list[tuple], cq.ReplayPager, int]:
    pager = cq.ReplayPager(PATTERNS, start)
    out: list[tuple] = []
    pages = 0
    while not pager.done:
        params = pager.params()
        answers = [cq.decode_answer(cq.encode_answer(
            cq.local_answer(params, cq.local_query(store, None, sid), sid), max_bytes, sid))[1]
            for sid, store in stores.items()]
        out += pager.take(answers)
        pages += 1
    return out, pager, pages


def key(e: tuple) -> tuple[float, int, int, int]:
    return (e[2], e[cq.SERVER], e[0], e[1])


def everything(stores: dict[int, RetentionStore]) -> list[tuple]:
    return sorted(((*e, sid) for sid, s in stores.items() for e in s._items
                   if e[5] == b"g"), key=key)


def test_replay_gives_every_event_once_in_order_past_the_answer_limit():
    n = 12_000  # each broker keeps more than one answer carries
    stores = {
        # broker 1: one event per millisecond; broker 2: the same instants
        # (equal timestamps across brokers); broker 3: in between, some in group h
        1: broker(1, [1000.0 + i / 1000 for i in range(n)], ["g"] * n),
        2: broker(2, [1000.0 + i / 1000 for i in range(n)], ["g"] * n),
        3: broker(3, [1000.0005 + i / 1000 for i in range(n)],
                  ["g" if i % 3 else "h" for i in range(n)]),
    }
    every = everything(stores)
    assert len(every) > 2 * QUERY_LIMIT
    start = key(every[100])
    got, pager, pages = replay(stores, start)
    assert [key(e) for e in got] == [key(e) for e in every[101:]]
    assert pager.done and not pager.gap and pages >= 2


def test_answers_cut_by_max_payload_still_page_through():
    stores = {sid: broker(sid, [50.0 + i / 100 + sid / 1000 for i in range(2_000)], ["g"] * 2_000)
              for sid in (1, 2)}
    every = everything(stores)
    start = key(every[0])
    got, pager, pages = replay(stores, start, max_bytes=20_000)  # ~150 events an answer
    assert [key(e) for e in got] == [key(e) for e in every[1:]]
    assert pages > 10 and not pager.gap


def test_more_events_with_one_timestamp_than_an_answer_holds_is_a_gap():
    n = QUERY_LIMIT + 10
    stores = {1: broker(1, [7.0] * n, ["g"] * n), 2: broker(2, [8.0], ["g"])}
    every = everything(stores)
    got, pager, _ = replay(stores, key(every[0]))
    assert pager.gap and pager.done
    # what was given is in order and complete up to where paging stopped
    assert [key(e) for e in got] == [key(e) for e in every[1:1 + len(got)]]
