"""Interop with the REAL PyPI ``hsp`` 0.1.0 package, run from its own virtualenv.

- as a client of the broker's HSP listener (tests/peers/hsp_lib_client.py);
- as the endpoint an HSP bridge dials (tests/peers/hsp_lib_server.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.peerenv import HSP_PEER, peer_python
from tests.ports import listener_port as free_port

pytestmark = [pytest.mark.trio, pytest.mark.peers]

PEERS = pathlib.Path(__file__).parents[2] / "peers"


@pytest.fixture(scope="module")
def hsp_python() -> pathlib.Path:
    return peer_python(HSP_PEER)


class LineReader:
    """JSON lines from a subprocess's stdout."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdout is not None
        self.stdout = proc.stdout
        self.buf = b""

    async def line(self, timeout: float = 20.0) -> dict:
        with trio.fail_after(timeout):
            while b"\n" not in self.buf:
                chunk = await self.stdout.receive_some(65536)
                if not chunk:
                    raise EOFError(f"peer exited; output so far: {self.buf!r}")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)




async def test_hsp_lib_client_against_the_listener(hsp_python):
    # Idle 1.5 s with ping_delay 0.2 and ping_timeout 0.5: a client that did not
    # answer PINGs would be closed long before it asks for its lname again.
    config = "[hsp]\nping_delay = 0.2\nping_timeout = 0.5\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with BrokerProcess(config) as broker:
        host, port = broker.addr["hsp"]
        async with SkanClient.connect(*broker.skan) as skan, trio.open_nursery() as nursery:
            await skan.subscribe("interop-back")
            proc = await nursery.start(lambda task_status: trio.run_process(
                [str(hsp_python), str(PEERS / "hsp_lib_client.py"), host, str(port), "1.5"],
                env=env, stdout=subprocess.PIPE, stderr=None, check=False,
                task_status=task_status,
            ))
            out = LineReader(proc)
            lname = (await out.line())["ready"]
            for i in range(3):
                await skan.send("interop", f"to-lib-{i}")
            back = [await skan.receive(), await skan.receive()]
            result = (await out.line())["result"]
            await proc.wait()
        assert proc.returncode == 0
    assert result["ping"] == "pong" and result["reply_type"] == 1
    assert result["received"] == [[1, skan.lname, f"to-lib-{i}"] for i in range(3)]
    assert [(m.sender, m.msg) for m in back] == [
        (lname, b"from-hsp-data"), (lname, b"from-hsp-ack")]
    errors = result["errors"]
    assert errors["unknown-type"][0] == 2 and "unknown Type 7" in errors["unknown-type"][1]
    assert errors["malformed"][0] == 1
    assert errors["wrong-from"][0] == 2 and "someone" in errors["wrong-from"][1]
    assert result["still_open"] is True  # answered the broker's idle PINGs


async def test_bridge_dials_the_hsp_lib_as_its_endpoint(hsp_python):
    port = free_port()
    count = 4
    config = f"""
[hsp]
ping_delay = 0.2
ping_timeout = 0.5

[[bridges]]
protocol = "hsp"
address = "127.0.0.1:{port}"
group = "lib"
type = 300
backoff_initial = 0.05
backoff_max = 0.2
"""
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(lambda task_status: trio.run_process(
            [str(hsp_python), str(PEERS / "hsp_lib_server.py"), str(port), str(count)],
            stdout=subprocess.PIPE, stderr=None, check=False, task_status=task_status,
        ))
        out = LineReader(proc)
        assert (await out.line())["listening"] == port
        with BrokerProcess(config) as broker:
            async with (
                SkanClient.connect(*broker.skan) as pub,
                SkanClient.connect(*broker.skan) as sub,
            ):
                await sub.subscribe("lib")
                assert (await out.line()) == {"connection": 1}
                for i in range(count - 1):
                    await pub.send("lib", f"to-lib-{i}")
                await pub.send("lib", {"structured": "yes"}, seq="99")
                lines = [await out.line() for _ in range(count)]
                assert (await out.line()) == {"sent": "ack"}
                seen = [await sub.receive() for _ in range(count + 2)]
                # The broker pings the idle endpoint; the library answers; the link stays up
                # (an unanswered PING would drop it and the bridge would connect again).
                await trio.sleep(1.5)
                await pub.send("lib", "after-idle")
                assert (await out.line()) == {"data": [300, b"after-idle".hex(), True]}
        proc.kill()
        nursery.cancel_scope.cancel()
    data = [line["data"] for line in lines]
    assert [d[0] for d in data] == [300] * count and all(d[2] for d in data)
    assert [bytes.fromhex(d[1]) for d in data[:-1]] == [
        f"to-lib-{i}".encode() for i in range(count - 1)]
    whole = bytes.fromhex(data[-1][1])
    assert whole.startswith(b"Skan") and b"structured" in whole
    inbound = [m for m in seen if m.sender != pub.lname]
    assert [(m.msg, m.header[b"hsp-type"]) for m in inbound] == [
        (b"lib-data", b"5"), (b"lib-ack", b"6")]
