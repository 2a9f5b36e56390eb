"""A REAL hat-chatter 0.5.11 client (Hat.Msg envelope of the Chatter text) speaking Eventer.

Run with the HAT08_PEER venv's python: ``seed_chatter_client.py PORT``.
Prints one JSON line per step: init, notify (after the test publishes to
group "seed"), register, then whether the connection survived several
ping rounds (ping_timeout 0.5 s: hat-chatter 0.5 pings every 0.5 s and
closes when a pong is later than that).
"""

import asyncio
import json
import pathlib
import sys

from hat import chatter, sbs

HERE = pathlib.Path(__file__).resolve().parent


def out(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


async def main(port):
    repo = sbs.Repository(chatter.sbs_repo, sbs.Repository.from_json(
        HERE / "hat_event_0.9.44_sbs_repo.json"))
    conn = await chatter.connect(repo, f"tcp+sbs://127.0.0.1:{port}", ping_timeout=0.5)
    conv = conn.send(chatter.Data("HatEventer", "MsgInitReq", {
        "clientName": "seed/client", "clientToken": ("none", None),
        "subscriptions": [["seed", "*"]], "serverId": ("none", None), "persisted": False}),
        last=False)
    res = await asyncio.wait_for(conn.receive(), 5)
    out(init=list(res.data.data), same_conv=res.conv == conv, module=res.data.module,
        type=res.data.type)
    note = await asyncio.wait_for(conn.receive(), 5)
    conn.send(chatter.Data("HatEventer", "MsgEventsAck", None), conv=note.conv)
    ev = note.data.data[0]
    out(notify_type=note.data.type, last=note.last, event_type=ev["type"],
        payload=list(ev["payload"][1]))
    conv = conn.send(chatter.Data("HatEventer", "MsgRegisterReq", [
        {"type": ["seed", "from-chatter"], "sourceTimestamp": ("none", None),
         "payload": ("value", ("json", json.dumps({"x": "y"})))}]), last=False)
    # Subscribed to what it registers: notified of it first, as by hat-event-server.
    own = await asyncio.wait_for(conn.receive(), 5)
    conn.send(chatter.Data("HatEventer", "MsgEventsAck", None), conv=own.conv)
    out(own_notify_type=own.data.type, event_type=own.data.data[0]["type"])
    res = await asyncio.wait_for(conn.receive(), 5)
    kind, evs = res.data.data
    out(register=kind, same_conv=res.conv == conv, type=res.data.type,
        registered_type=evs[0]["type"])
    await asyncio.sleep(1.6)
    out(open=conn.is_open)
    await conn.async_close()


asyncio.run(main(int(sys.argv[1])))
