"""A REAL hat-event 0.9.44 Eventer client driven by JSON-line commands on stdin.

Run with the EVENTER09_PEER venv's python.  Each stdin line is a command
``{"op": ...}``; each gets exactly one JSON line on stdout in answer.
Events are printed as {"id": [server, session, instance], "type": [...],
"timestamp": float, "source_timestamp": float|null, "payload": ...} with
payload {"json": value} | {"binary": [type, hex]} | null.
"""

import asyncio
import json
import ssl
import sys

from hat.drivers import net
from hat.event import common, eventer


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


def payload_from(p):
    if p is None:
        return None
    if "json" in p:
        return common.EventPayloadJson(p["json"])
    return common.EventPayloadBinary(p["binary"][0], bytes.fromhex(p["binary"][1]))


def opt_ts(v):
    return None if v is None else common.timestamp_from_float(v)


def opt_id(v):
    return None if v is None else common.EventId(*v)


def types(v):
    return None if v is None else [tuple(t) for t in v]


class Driver:
    def __init__(self):
        self.client = None
        self.events = []
        self.new_events = asyncio.Event()
        self.statuses = []

    def on_events(self, client, evs):
        self.events.extend(evs)
        self.new_events.set()

    def on_status(self, client, status):
        self.statuses.append(status.value)

    async def op_connect(self, port, name="test/client", token=None, subscriptions=(),
                         ping_delay=30, ping_timeout=10, server_id=None, persisted=False,
                         tls=None):
        # tls: {"ca": PEM file, "cert": PEM file with key, or absent} -> over TLS
        # (asyncio's ssl argument, which hat-drivers passes through).
        kwargs = {}
        if tls is not None:
            ctx = ssl.create_default_context(cafile=tls["ca"])
            if tls.get("cert"):
                ctx.load_cert_chain(tls["cert"])
            kwargs["ssl"] = ctx
        try:
            self.client = await eventer.connect(
                net.TcpAddress("127.0.0.1", port), name, client_token=token,
                subscriptions=[tuple(s) for s in subscriptions], server_id=server_id,
                persisted=persisted, events_cb=self.on_events, status_cb=self.on_status,
                ping_delay=ping_delay, ping_timeout=ping_timeout, **kwargs)
        except eventer.EventerInitError as e:
            return {"init_error": str(e)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {"status": self.client.status.value}

    async def op_register(self, events, with_response=True):
        reg = [common.RegisterEvent(type=tuple(e["type"]),
                                    source_timestamp=opt_ts(e.get("source_timestamp")),
                                    payload=payload_from(e.get("payload")))
               for e in events]
        res = await asyncio.wait_for(self.client.register(reg, with_response), 5)
        if not with_response:
            return {"sent": len(reg)}
        return {"events": None if res is None else [event_json(e) for e in res]}

    async def op_query(self, kind, **kw):
        if kind == "latest":
            params = common.QueryLatestParams(types(kw.get("event_types")))
        elif kind == "timeseries":
            params = common.QueryTimeseriesParams(
                event_types=types(kw.get("event_types")),
                t_from=opt_ts(kw.get("t_from")), t_to=opt_ts(kw.get("t_to")),
                source_t_from=opt_ts(kw.get("source_t_from")),
                source_t_to=opt_ts(kw.get("source_t_to")),
                order=common.Order(kw.get("order", "descending")),
                order_by=common.OrderBy(kw.get("order_by", "timestamp")),
                max_results=kw.get("max_results"),
                last_event_id=opt_id(kw.get("last_event_id")))
        else:
            params = common.QueryServerParams(
                server_id=kw["server_id"], persisted=kw.get("persisted", False),
                max_results=kw.get("max_results"),
                last_event_id=opt_id(kw.get("last_event_id")))
        res = await asyncio.wait_for(self.client.query(params), 5)
        return {"events": [event_json(e) for e in res.events],
                "more_follows": res.more_follows}

    async def op_events(self, count, timeout=5.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.events) < count and loop.time() < deadline:
            self.new_events.clear()
            try:
                await asyncio.wait_for(self.new_events.wait(), deadline - loop.time())
            except TimeoutError:
                break
        got, self.events = self.events, []
        return {"events": [event_json(e) for e in got]}

    async def op_sleep(self, seconds):
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    async def op_state(self):
        return {"is_open": self.client.is_open, "status": self.client.status.value,
                "statuses": self.statuses}

    async def op_wait_closed(self, timeout=5.0):
        try:
            await asyncio.wait_for(self.client.wait_closed(), timeout)
        except TimeoutError:
            return {"closed": False}
        return {"closed": True, "statuses": self.statuses}

    async def op_close(self):
        if self.client:
            await self.client.async_close()
        return {"closed": True}


async def main():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    driver = Driver()
    while True:
        line = await reader.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            result = await getattr(driver, "op_" + op)(**cmd)
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        if op == "close":
            break


asyncio.run(main())
