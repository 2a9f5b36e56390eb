"""Announce an Eventer server (the broker) to a REAL hat-monitor 0.8 server.

Run with the HAT_GATEWAY_PEER venv's python:
``monitor_event_server.py MONITOR_PORT GROUP SERVER_ID EVENTER_PORT``.

hat-event-server, run with ``monitor_component``, is a hat-monitor component
whose ``data`` (hat-event://monitor_data.yaml: server_id, eventer_server,
server_token) tells Hat components in monitor mode where its Eventer
listener is; they connect to the blessed component of their
``event_server_group``.  The broker does not speak hat-monitor's component
protocol (docs/eventer.md), so this component, built with hat-monitor's own
client library, announces the broker in its place.  It prints
``{"active": true}`` each time hat-monitor blesses it, and runs until stdin
closes.
"""

import asyncio
import json
import sys

from hat import aio
from hat.drivers import net
from hat.monitor import component


class Runner(aio.Resource):
    def __init__(self):
        self._group = aio.Group()

    @property
    def async_group(self):
        return self._group


async def main(monitor_port, group, server_id, eventer_port):
    def on_active(comp):
        out({"active": True})
        return Runner()

    comp = await component.connect(
        net.TcpAddress("127.0.0.1", monitor_port), "skan-broker", group, on_active,
        data={"server_id": server_id,
              "eventer_server": {"host": "127.0.0.1", "port": eventer_port},
              "server_token": None})
    await comp.set_ready(True)
    out({"connected": True})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()
    await comp.async_close()


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
