"""One scripted session of REAL hat-event 0.9.44 Eventer clients against a server.

Run with the EVENTER09_PEER venv's python: ``eventer09_session.py PORT SERVER_ID``.
The same script runs against hat-event-server 0.9.44 and against the broker
(tests/protocols/eventer/test_hat_server_differential.py); it prints one JSON
document: ``{"steps": [[name, result], ...]}``.  Ids and timestamps are
printed raw; the test normalises them to ranks before comparing.

Every client sees only the ``diff`` subtree (its own subscriptions and query
filters), so what one server registers of its own elsewhere does not enter
the comparison except where a step asks for everything on purpose.
"""

import asyncio
import json
import sys

from hat.drivers import net
from hat.event import common, eventer

T0 = 1_700_000_000.0  # source timestamps the script sets (seconds)


def ts(t):
    return None if t is None else common.timestamp_to_float(t)


def event_json(e):
    p = e.payload
    if isinstance(p, common.EventPayloadJson):
        payload = {"json": p.data}
    elif isinstance(p, common.EventPayloadBinary):
        payload = {"binary": [p.type, p.data.hex()]}
    else:
        payload = None
    return {"id": [e.id.server, e.id.session, e.id.instance], "type": list(e.type),
            "timestamp": ts(e.timestamp), "source_timestamp": ts(e.source_timestamp),
            "payload": payload}


def reg(type_, payload=None, source=None):
    if payload is None:
        p = None
    elif isinstance(payload, tuple):
        p = common.EventPayloadBinary(payload[0], payload[1])
    else:
        p = common.EventPayloadJson(payload["json"])
    return common.RegisterEvent(
        type=tuple(type_.split("/")),
        source_timestamp=None if source is None else common.timestamp_from_float(T0 + source),
        payload=p)


class Client:
    def __init__(self, name):
        self.name = name
        self.client = None
        self.notifies = []  # one list per MsgEventsNotify (the grouping matters)
        self.statuses = []
        self.changed = asyncio.Event()

    def on_events(self, client, events):
        self.notifies.append([event_json(e) for e in events])
        self.changed.set()

    def on_status(self, client, status):
        self.statuses.append(status.value)

    async def connect(self, port, subscriptions=(), persisted=False, server_id=None):
        self.client = await eventer.connect(
            net.TcpAddress("127.0.0.1", port), self.name,
            subscriptions=[tuple(s.split("/")) for s in subscriptions],
            server_id=server_id, persisted=persisted,
            events_cb=self.on_events, status_cb=self.on_status)
        return self.client.status.value

    async def take(self, count, timeout=5.0):
        """The notifies received until ``count`` events arrived (or the timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while sum(map(len, self.notifies)) < count and loop.time() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
            except TimeoutError:
                break
        # A little longer: a notify beyond the expected count must show too.
        await asyncio.sleep(0.1)
        got, self.notifies = self.notifies, []
        return got


def query_result(res):
    return {"events": [event_json(e) for e in res.events], "more_follows": res.more_follows}


async def page_all(client, make, limit=20):
    """Every page of a paged query: each page's events and moreFollows."""
    pages = []
    last = None
    for _ in range(limit):
        res = await asyncio.wait_for(client.query(make(last)), 5)
        pages.append(query_result(res))
        if not res.more_follows or not res.events:
            break
        last = res.events[-1].id
    return pages


def source_ts(offset):
    return None if offset is None else common.timestamp_from_float(T0 + offset)


def timeseries(types=None, order="descending", order_by="timestamp", max_results=None,
               last=None, source_from=None, source_to=None, t_from=None, t_to=None):
    return common.QueryTimeseriesParams(
        event_types=None if types is None else [tuple(t.split("/")) for t in types],
        t_from=None if t_from is None else common.timestamp_from_float(t_from),
        t_to=None if t_to is None else common.timestamp_from_float(t_to),
        source_t_from=source_ts(source_from), source_t_to=source_ts(source_to),
        order=common.Order(order), order_by=common.OrderBy(order_by),
        max_results=max_results, last_event_id=last)


async def session(port, server_id):
    steps = []

    def step(name, result):
        steps.append([name, result])

    star = Client("diff/star")         # diff/*
    q = Client("diff/question")        # diff/?/x and diff/?
    pers = Client("diff/persisted")    # diff/* with persisted=True
    reg_c = Client("diff/register")    # no subscription
    deep = Client("diff/deep")         # diff/?/* (a '?' before the '*')
    mine = Client("diff/mine")         # diff/* of this server's events (serverId)
    other = Client("diff/other")       # diff/* of another server's events
    step("connect star", await star.connect(port, ["diff/*"]))
    step("connect question", await q.connect(port, ["diff/?/x", "diff/?"]))
    step("connect persisted", await pers.connect(port, ["diff/*"], persisted=True))
    step("connect register", await reg_c.connect(port))
    step("connect deep", await deep.connect(port, ["diff/?/*"]))
    step("connect mine", await mine.connect(port, ["diff/*"], server_id=server_id))
    step("connect other", await other.connect(port, ["diff/*"], server_id=server_id + 1))

    # 1. Register with response: JSON of every kind, binary, no payload,
    #    with and without source timestamps.
    batch1 = [
        reg("diff/a/x", {"json": True}, source=5),
        reg("diff/b/x", {"json": 1234}, source=1),
        reg("diff/a/y", ("bytes-kind", b"\x00\xffhat"), source=3),
        reg("diff/c", {"json": {"k": [1, 2.5, None, "s", False], "z": {"n": -7}}}),
        reg("diff/d/e/f", None, source=2),
    ]
    res = await asyncio.wait_for(reg_c.client.register(batch1, True), 5)
    first_session = res
    step("register 1 response", [event_json(e) for e in res])
    step("star notifies 1", await star.take(5))
    step("question notifies 1", await q.take(3))
    step("deep notifies 1", await deep.take(4))
    step("mine notifies 1", await mine.take(5))
    step("other notifies 1", await other.take(1, timeout=0.5))

    # 2. Register without response, two requests back to back.
    r = await asyncio.wait_for(reg_c.client.register(
        [reg("diff/a/x", {"json": False}, source=4), reg("diff/e", {"json": "text"})], False), 5)
    step("register 2 response", r)
    r = await asyncio.wait_for(reg_c.client.register(
        [reg("diff/b/x", {"json": 1.5}, source=6)], False), 5)
    step("register 3 response", r)
    step("star notifies 2-3", await star.take(3))
    step("question notifies 2-3", await q.take(3))

    # Edge cases: an empty request, an empty type segment.
    step("register empty", await asyncio.wait_for(reg_c.client.register([], True), 5))
    res = await asyncio.wait_for(reg_c.client.register(
        [reg("diff/edge//x", {"json": 0})], True), 5)
    edge = res
    step("register empty segment", None if res is None else [event_json(e) for e in res])
    step("star notifies edge", await star.take(1, timeout=1.0))

    # 3. A subscriber registers an event it is itself subscribed to.
    res = await asyncio.wait_for(star.client.register([reg("diff/own", {"json": [1]})], True), 5)
    step("own register response", [event_json(e) for e in res])
    step("star notifies own", await star.take(1, timeout=1.0))

    # 4. Persisted subscriber: everything, after the flush.
    step("persisted notifies", await pers.take(9))

    # 5. Latest.
    for types in (["diff/*"], ["diff/?/x"], ["diff/?"], ["diff/a/*"], ["nothing/*"]):
        res = await asyncio.wait_for(
            reg_c.client.query(common.QueryLatestParams([tuple(t.split("/")) for t in types])), 5)
        step(f"latest {types}", query_result(res))

    # 6. Timeseries: whole, paged, both orders, by source timestamp, filtered.
    step("timeseries all desc", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/*"])), 5)))
    step("timeseries all asc", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/*"], order="ascending")), 5)))
    for order in ("descending", "ascending"):
        for order_by in ("timestamp", "sourceTimestamp"):
            step(f"timeseries paged {order} {order_by}", await page_all(
                reg_c.client, lambda last, o=order, ob=order_by: timeseries(
                    ["diff/*"], order=o, order_by=ob, max_results=3, last=last)))
    step("timeseries ?/x", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/?/x"])), 5)))
    step("timeseries source window", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/*"], order_by="sourceTimestamp",
                                      source_from=2, source_to=5)), 5)))
    # A timestamp window: after the first request, up to the edge-case event
    # (inclusive), so the last request (diff/own) is left out.
    after_first = max(common.timestamp_to_float(e.timestamp) for e in first_session) + 1e-6
    step("timeseries time window", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/*"], t_from=after_first,
                                      t_to=common.timestamp_to_float(edge[0].timestamp))), 5)))
    step("timeseries no types", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries([])), 5)))
    step("timeseries max 0", query_result(await asyncio.wait_for(
        reg_c.client.query(timeseries(["diff/*"], max_results=0)), 5)))

    # 7. Server query: everything of this server, paged, persisted or not.
    for persisted in (False, True):
        pages = await page_all(reg_c.client, lambda last, p=persisted: common.QueryServerParams(
            server_id=server_id, persisted=p, max_results=4, last_event_id=last))
        # Only the diff subtree, pages joined: a server may have registered
        # events of its own (hat-event-server does, see "server's own" below),
        # and they take places in its pages.
        step(f"server persisted={persisted}", {
            "events": [e for page in pages for e in page["events"] if e["type"][0] == "diff"],
            "last_more_follows": pages[-1]["more_follows"]})
    res = await asyncio.wait_for(reg_c.client.query(common.QueryLatestParams(None)), 5)
    step("server's own event types", sorted({"/".join(e.type[:2]) for e in res.events
                                             if e.type[0] != "diff"}))
    res = await asyncio.wait_for(reg_c.client.query(common.QueryServerParams(
        server_id=server_id + 100)), 5)
    step("server other id", query_result(res))

    # 8. Status.
    step("statuses", {"star": [star.client.status.value, star.statuses],
                      "register": [reg_c.client.status.value, reg_c.statuses]})
    for c in (star, q, pers, reg_c, deep, mine, other):
        await c.client.async_close()
    return steps


def main():
    port, server_id = int(sys.argv[1]), int(sys.argv[2])
    steps = asyncio.run(session(port, server_id))
    sys.stdout.write(json.dumps({"steps": steps}) + "\n")


main()
