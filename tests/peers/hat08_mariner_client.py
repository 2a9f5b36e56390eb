"""REAL hat-event 0.8.17 Mariner client (hat.event.mariner.connect), driven by a test.

    python hat08_mariner_client.py PORT [--token T] [--last-event-id S,SE,I]
                                   [--subscriptions JSON] [--client-id ID]

Prints JSON lines: {"connected": true} once init is sent, {"event": {...}} per
received event, {"closed": true} when the connection closes.  Ends when the
connection closes or stdin reaches EOF.
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


def event_json(event):
    payload = event.payload
    if payload is None:
        pj = None
    elif payload.type == common.EventPayloadType.JSON:
        pj = {"type": "json", "data": payload.data}
    elif payload.type == common.EventPayloadType.BINARY:
        pj = {"type": "binary", "data": base64.b64encode(payload.data).decode()}
    else:
        pj = {"type": "sbs", "module": payload.data.module, "name": payload.data.type,
              "data": base64.b64encode(payload.data.data).decode()}
    return {"id": list(event.event_id), "type": list(event.event_type),
            "timestamp": list(event.timestamp),
            "source_timestamp": None if event.source_timestamp is None
            else list(event.source_timestamp),
            "payload": pj}


async def main(args):
    last = None
    if args.last_event_id:
        server, session, instance = (int(x) for x in args.last_event_id.split(","))
        last = common.EventId(server, session, instance)
    subscriptions = [tuple(s) for s in json.loads(args.subscriptions)]

    def on_events(events):
        for event in events:
            out({"event": event_json(event)})

    client = await mariner.connect(tcp.Address("127.0.0.1", args.port), args.client_id,
                                   client_token=args.token, last_event_id=last,
                                   subscriptions=subscriptions, events_cb=on_events,
                                   ping_delay=args.ping_delay, ping_timeout=2)
    out({"connected": True})
    loop = asyncio.get_running_loop()
    stdin_eof = loop.run_in_executor(None, sys.stdin.read)
    closing = asyncio.ensure_future(client.wait_closing())
    await asyncio.wait([stdin_eof, closing], return_when=asyncio.FIRST_COMPLETED)
    if closing.done():
        out({"closed": True})
    await client.async_close()
    closing.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--client-id", default="hat08-test")
    p.add_argument("--token")
    p.add_argument("--last-event-id")
    p.add_argument("--subscriptions", default='[["*"]]')
    p.add_argument("--ping-delay", type=float, default=30)
    asyncio.run(main(p.parse_args()))
    # The stdin reader thread may still block; leave without waiting for it.
    sys.stdout.flush()
    import os
    os._exit(0)
