"""REAL hat-event 0.8.17 Mariner server (hat.event.mariner.listen), driven by a test.

    python hat08_mariner_server.py [--server-id 7] [--ping-delay 30]

Prints {"listening": PORT}, then {"connection": {...init fields...}} per
accepted client.  Commands on stdin, one JSON object per line:
  {"events": [{"id": [SERVER, SESSION, INSTANCE], "type": [...], "payload": P,
               "source": [S, US] (optional source timestamp)}, ...]}
      P = null | {"type": "json", "data": ...} | {"type": "binary", "b64": ...}
        | {"type": "sbs", "module": M, "name": T, "b64": ...}
      sends one events message to every open connection whose subscription
      matches (as Hat's own server does); prints {"sent": N}
  {"close": true}   closes every open connection; prints {"closed": N}
"""

import argparse
import asyncio
import base64
import json
import sys

from hat.drivers import tcp
from hat.event import mariner
from hat.event.mariner import common


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def payload_from(p):
    if p is None:
        return None
    if p["type"] == "json":
        return common.EventPayload(common.EventPayloadType.JSON, p["data"])
    if p["type"] == "binary":
        return common.EventPayload(common.EventPayloadType.BINARY, base64.b64decode(p["b64"]))
    return common.EventPayload(common.EventPayloadType.SBS, common.SbsData(
        p["module"], p["name"], base64.b64decode(p["b64"])))


async def main(args):
    conns = []

    def on_connection(conn):
        conns.append(conn)
        last = conn.last_event_id
        out({"connection": {
            "client_id": conn.client_id, "client_token": conn.client_token,
            "last_event_id": None if last is None else list(last),
            "subscriptions": [list(t) for t in conn.subscription.get_query_types()],
        }})

    server = await mariner.listen(tcp.Address("127.0.0.1", 0), on_connection,
                                  ping_delay=args.ping_delay, ping_timeout=2,
                                  subscriptions=[("*",)])
    # hat.event.mariner.Server keeps its tcp.Server private; its address is there.
    out({"listening": server._server.addresses[0].port})
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if "events" in cmd:
            now = common.now()
            events = [common.Event(common.EventId(*e["id"]), tuple(e["type"]), now,
                                   common.Timestamp(*e["source"]) if e.get("source") else None,
                                   payload_from(e.get("payload"))) for e in cmd["events"]]
            sent = 0
            for conn in [c for c in conns if c.is_open]:
                matching = [e for e in events if conn.subscription.matches(e.event_type)]
                if matching:
                    await conn.send_events(matching)
                    sent += 1
            out({"sent": sent})
        elif cmd.get("close"):
            open_conns = [c for c in conns if c.is_open]
            for conn in open_conns:
                await conn.async_close()
            out({"closed": len(open_conns)})
    await server.async_close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ping-delay", type=float, default=30)
    asyncio.run(main(p.parse_args()))
