"""A Modbus TCP slave simulated with REAL hat-drivers (``hat.drivers.modbus``) on loopback.

Run with the HAT_GATEWAY_PEER venv's python: ``modbus_slave.py PORT``.  It
holds registers of every type in memory (all 0 at start) and answers reads,
writes and mask writes from any device id.  Prints ``{"listening": PORT}``
once up; then each stdin line is a command with one JSON answer:
``{"op": "set", "data_type": "HOLDING_REGISTER", "address": A, "value": V}``
changes a register (what the device "measures"), ``{"op": "writes"}``
returns the writes received so far (and forgets them), ``{"op": "close"}``.
"""

import asyncio
import contextlib
import json
import sys

from hat.drivers import modbus, net


class Memory:
    def __init__(self):
        self.values = {t: {} for t in modbus.DataType}
        self.writes = []
        self.written = asyncio.Event()

    async def on_request(self, slave, req):
        if isinstance(req, modbus.ReadReq):
            regs = self.values[req.data_type]
            return [regs.get(req.start_address + i, 0) for i in range(req.quantity)]
        if isinstance(req, modbus.WriteReq):
            regs = self.values[req.data_type]
            for i, v in enumerate(req.values):
                regs[req.start_address + i] = v
            self.writes.append({"device_id": req.device_id, "data_type": req.data_type.name,
                                "address": req.start_address, "values": list(req.values)})
            self.written.set()
            return modbus.Success()
        if isinstance(req, modbus.WriteMaskReq):
            regs = self.values[modbus.DataType.HOLDING_REGISTER]
            regs[req.address] = modbus.apply_mask(regs.get(req.address, 0), req.and_mask,
                                                  req.or_mask)
            self.writes.append({"device_id": req.device_id, "mask": True,
                                "address": req.address, "values": [regs[req.address]]})
            self.written.set()
            return modbus.Success()
        return modbus.Error.INVALID_FUNCTION_CODE


async def main(port):
    memory = Memory()
    server = await modbus.create_tcp_server(modbus.ModbusType.TCP,
                                            net.TcpAddress("127.0.0.1", port),
                                            request_cb=memory.on_request)
    out({"listening": port})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "set":
                memory.values[modbus.DataType[cmd["data_type"]]][cmd["address"]] = cmd["value"]
                out({"ok": True})
            elif op == "writes":
                if not memory.writes:
                    memory.written.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(memory.written.wait(), cmd.get("timeout", 5))
                got, memory.writes = memory.writes, []
                out({"writes": got})
            elif op == "close":
                out({"closed": True})
                break
    finally:
        await server.async_close()


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


asyncio.run(main(int(sys.argv[1])))
