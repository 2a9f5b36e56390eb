"""The REAL PyPI ``hsp`` 0.1.0 as the HSP endpoint a broker bridge dials.

Run with the peer venv's python:  python hsp_lib_server.py PORT COUNT
Prints {"listening": PORT}, {"connection": N} for each accepted connection,
then one {"data": [type, payload-hex, acked]}
line per message received; after COUNT messages it sends a DATA (Type 5,
"lib-data") and a DATA_ACK (Type 6, "lib-ack") to the bridge, prints
{"sent": "ack"} once the broker ACKed, and keeps serving until killed.
"""

import json
import sys

import trio

trio.hazmat = trio.lowlevel  # hsp 0.1.0 was written for trio 0.9-era names
trio.open_cancel_scope = trio.CancelScope

import hsp  # noqa: E402  (the real library)


def emit(obj):
    print(json.dumps(obj), flush=True)


async def handle(stream, count):
    async with (
        trio.open_nursery() as nursery,
        hsp.StreamBuffer(stream, nursery) as sb,
        hsp.HspConnection(sb, nursery) as conn,
    ):
        for _ in range(count):
            data = await conn.recv()
            emit({"data": [data.msg_type, bytes(data.payload).hex(), data._msg_id is not None]})
            data.ack()
        conn.send(5, b"lib-data")
        await conn.send_ack(6, b"lib-ack")
        emit({"sent": "ack"})
        while True:  # keep answering (PINGs are handled by the library)
            data = await conn.recv()
            emit({"data": [data.msg_type, bytes(data.payload).hex(), data._msg_id is not None]})
            data.ack()


async def main(port, count):
    connections = 0

    async def handler(stream):
        nonlocal connections
        connections += 1
        emit({"connection": connections})
        try:
            await handle(stream, count)
        except Exception as exc:  # one broken connection must not end the server
            emit({"error": repr(exc)})

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    emit({"listening": port})
    await trio.serve_listeners(handler, listeners)


trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
