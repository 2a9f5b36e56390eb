"""The REAL PyPI ``hsp`` 0.1.0 client against the broker's HSP listener.

Run with the peer venv's python (tests/peerenv.py HSP_PEER) and PYTHONPATH
set to the project root (only ``wire.skan``, pure Python, is imported from
it to build Skan messages):  python hsp_lib_client.py HOST PORT

Prints JSON lines on stdout: {"ready": LNAME} once subscribed to "interop",
then {"result": {...}} with what it saw.  The test drives the other side.
"""

import json
import sys

import trio

trio.hazmat = trio.lowlevel  # hsp 0.1.0 was written for trio 0.9-era names
trio.open_cancel_scope = trio.CancelScope

import hsp  # noqa: E402  (the real library)

from wire.skan import decode, encode  # noqa: E402


def emit(obj):
    print(json.dumps(obj), flush=True)


async def main(host, port):
    result = {}
    stream = await trio.open_tcp_stream(host, port)
    async with (
        trio.open_nursery() as nursery,
        hsp.StreamBuffer(stream, nursery) as sb,
        hsp.HspConnection(sb, nursery) as conn,
    ):
        inbox_send, inbox = trio.open_memory_channel(100)

        async def receiver():
            while True:
                data = await conn.recv()
                data.ack()
                await inbox_send.send((data.msg_type, bytes(data.payload)))

        async with trio.open_nursery() as inner:
            inner.start_soon(receiver)
            await talk(conn, inbox, result)
            inner.cancel_scope.cancel()
        # hsp 0.1.0 turns a cancellation that hits its reader in the middle of
        # a receive into an exception; its reader only idles (and so shuts
        # down cleanly) once nothing is outstanding.  A last PING lets it
        # read the PONG and go idle before the context exits.
        await conn.ping()
        emit({"result": result})
        # Its StreamBuffer can miss the wake-up that ends its sender and then
        # waits 30 s on exit; cancelling here ends everything at once.
        nursery.cancel_scope.cancel()


async def talk(conn, inbox, result):
    await conn.ping()
    result["ping"] = "pong"
    # getlname over DATA_ACK: send_ack returns on ACK; the reply is a DATA.
    await conn.send_ack(1, encode({"type": "getlname"}))
    msg_type, payload = await inbox.receive()
    lname = decode(payload)[b"lname"].decode()
    result["reply_type"] = msg_type
    await conn.send_ack(1, encode({"type": "subscribe", "group": "interop",
                                  "instance": "*"}))
    emit({"ready": lname})

    got = []
    for _ in range(3):
        msg_type, payload = await inbox.receive()
        m = decode(payload)
        got.append([msg_type, m[b"from"].decode(), m[b"msg"].decode()])
    result["received"] = got

    base = {"type": "send", "group": "interop-back", "instance": "*", "to": "*",
            "from": lname}
    conn.send(1, encode({**base, "seq": "1", "msg": "from-hsp-data"}))
    await conn.send_ack(1, encode({**base, "seq": "2", "msg": "from-hsp-ack"}))

    errors = {}
    for name, typ, payload in (
        ("unknown-type", 7, b"x"),
        ("malformed", 1, b"garbage"),
        ("wrong-from", 1, encode({**base, "from": "someone", "seq": "3", "msg": ""})),
    ):
        try:
            await conn.send_ack(typ, payload)
            errors[name] = "ACK"
        except hsp.DataError as exc:
            errors[name] = [exc.code, bytes(exc.payload).decode()]
    result["errors"] = errors

    # Stay idle past the broker's ping_delay: the library must answer its PINGs.
    await trio.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    await conn.send_ack(1, encode({"type": "getlname"}))
    msg_type, payload = await inbox.receive()
    result["still_open"] = decode(payload)[b"lname"].decode() == lname


trio.run(main, sys.argv[1], int(sys.argv[2]))
