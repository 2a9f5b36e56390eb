"""A REAL hat-event 0.9.44 Eventer server (``hat.event.eventer.listen``) driven over stdin.

Run with the EVENTER09_PEER venv's python (optional argument: the port).  Prints {"port": P} once
listening, then answers one JSON line per command.  Registered events get
ids (server 7, a new session per request) and are notified to matching
clients BEFORE the register response is sent, as a real event server may.
"""

import asyncio
import itertools
import json
import sys
import time

from hat.drivers import net
from hat.event import common, eventer

SERVER_ID = 7


def event_json(e):
    p = e.payload
    if isinstance(p, common.EventPayloadJson):
        payload = {"json": p.data}
    elif isinstance(p, common.EventPayloadBinary):
        payload = {"binary": [p.type, p.data.hex()]}
    else:
        payload = None
    ts = e.source_timestamp
    return {"id": [e.id.server, e.id.session, e.id.instance], "type": list(e.type),
            "source_timestamp": None if ts is None else common.timestamp_to_float(ts),
            "payload": payload}


def payload_from(p):
    if p is None:
        return None
    if "json" in p:
        return common.EventPayloadJson(p["json"])
    return common.EventPayloadBinary(p["binary"][0], bytes.fromhex(p["binary"][1]))


class Driver:
    def __init__(self):
        self.sessions = itertools.count(1)
        self.registered = []
        self.server = None
        self.clients = []

    def make_events(self, regs):
        session = next(self.sessions)
        now = common.timestamp_from_float(time.time())
        return [common.Event(id=common.EventId(SERVER_ID, session, i + 1), type=r.type,
                             timestamp=now, source_timestamp=r.source_timestamp,
                             payload=r.payload)
                for i, r in enumerate(regs)]

    async def on_register(self, info, regs):
        events = self.make_events(regs)
        self.registered.extend(events)
        await self.server.notify_events(events, persisted=False, with_ack=False)
        return events

    async def on_connected(self, info):
        self.clients.append({"name": info.client_name, "token": info.client_token,
                             "subscriptions": [list(t) for t in
                                               info.subscription.get_query_types()]})

    async def start(self, port):
        self.server = await eventer.listen(
            net.TcpAddress("127.0.0.1", port), status=common.Status.OPERATIONAL,
            register_cb=self.on_register, connected_cb=self.on_connected)
        return self.server._srv.info.addresses[0].port

    async def op_notify(self, events):
        regs = [common.RegisterEvent(tuple(e["type"]), None, payload_from(e.get("payload")))
                for e in events]
        evs = self.make_events(regs)
        await asyncio.wait_for(self.server.notify_events(evs, persisted=False, with_ack=True),
                               5)
        return {"notified": [event_json(e) for e in evs]}

    async def op_registered(self, count=0, timeout=5.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.registered) < count and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return {"events": [event_json(e) for e in self.registered]}

    async def op_clients(self, count=1, timeout=10.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.server.get_conn_infos()) < count and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return {"clients": self.clients, "connected": len(self.server.get_conn_infos())}

    async def op_sleep(self, seconds):
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    async def op_close(self):
        await self.server.async_close()
        return {"closed": True}


async def main():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    driver = Driver()
    port = await driver.start(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    sys.stdout.write(json.dumps({"port": port}) + "\n")
    sys.stdout.flush()
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
