"""HSP benchmark: Skan-over-HSP publishing against native Skan, 1 publisher -> 1 subscriber.

    python -m bench.hsp_bench                  # starts its own broker
    python -m bench.hsp_bench --seconds 10 --rounds 3

Scenarios (100-byte messages, the same frames as bench.skan_load):
- skan 1->1      native Skan publisher, Skan subscriber (the reference)
- hsp-data 1->1  publisher sends each Skan message as HSP DATA Type 1
- hsp-ack 1->1   publisher sends DATA_ACK Type 1 and reads the broker's ACKs
- hsp->hsp 1->1  DATA publisher and an HSP subscriber (deliveries as DATA Type 1)

Method (bench.skan_load): publishers write large buffers of identical
pre-encoded messages, subscribers only count received bytes, deliveries =
bytes / delivered size.  The figure for the issue target is the ratio
hsp-data / skan (target >= 0.5); the runs alternate so both see the same
machine load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from bench.skan_load import BATCH, PAYLOAD, Broker, Result, send_frame, subscribe, throughput
from wire.hsp import Ack, DataAck, Decoder, data_prefix, encode
from wire.skan import decode, encode_frame

SKAN_DATA = data_prefix(1)


async def hsp_connect(addr: tuple[str, int]) -> tuple[trio.SocketStream, bytes]:
    """Connect to the HSP listener and ask for the lname (DATA Type 1 getlname)."""
    stream = await trio.open_tcp_stream(*addr)
    await stream.send_all(SKAN_DATA + encode_frame({"type": "getlname"}))
    decoder = Decoder()
    while True:
        for ev in decoder.receive_data(await stream.receive_some(4096)):
            return stream, decode(ev.payload)[b"lname"]


async def hsp_subscribe(addr: tuple[str, int], group: str) -> trio.SocketStream:
    stream, _ = await hsp_connect(addr)
    await stream.send_all(SKAN_DATA + encode_frame({"type": "subscribe", "group": group,
                                                    "instance": "*"}))
    await stream.send_all(SKAN_DATA + encode_frame({"type": "getlname"}))  # barrier
    decoder = Decoder()
    while not decoder.receive_data(await stream.receive_some(4096)):
        pass
    return stream


async def hsp_throughput(broker: Broker, mode: str, seconds: float,
                         warmup: float = 1.0) -> Result:
    """One HSP publisher floods a group; one subscriber (Skan or HSP) counts bytes."""
    hsp_addr, skan_addr = broker.addr["hsp"], broker.addr["skan"]
    group = f"hsp-bench-{mode}-{time.monotonic_ns()}"
    if mode == "hsp->hsp":
        sub = await hsp_subscribe(hsp_addr, group)
    else:
        sub = await subscribe(skan_addr, group)
    pub, lname = await hsp_connect(hsp_addr)
    frame = send_frame(lname, group, b"x" * PAYLOAD)
    delivered_size = len(frame) + (len(SKAN_DATA) if mode == "hsp->hsp" else 0)
    received = [0]
    acks = [0]

    async def publish_data() -> None:
        buf = (SKAN_DATA + frame) * BATCH
        while True:
            await pub.send_all(buf)

    async def publish_acked() -> None:
        # DATA_ACK with MessageIDs cycling through a window of BATCH * 4; a
        # batch is written only when the previous-but-one has been ACKed, so
        # no MessageID is reused before its answer.
        message = frame[4:]
        batches = [b"".join(encode(DataAck.make(k * BATCH + i, 1, message))
                            for i in range(BATCH)) for k in range(4)]
        sent = 0
        k = 0
        while True:
            while sent - acks[0] > 2 * BATCH:
                await ack_seen.wait()
            await pub.send_all(batches[k])
            sent += BATCH
            k = (k + 1) % 4

    ack_seen = trio.Event()

    async def read_acks() -> None:
        nonlocal ack_seen
        decoder = Decoder()
        while True:
            data = await pub.receive_some(1 << 20)
            if not data:
                raise RuntimeError("broker closed the publisher")
            events = decoder.receive_data(data)
            for e in events:
                if type(e) is not Ack:
                    raise RuntimeError(f"broker refused a message: {e!r}")
            acks[0] += len(events)
            ack_seen.set()
            ack_seen = trio.Event()

    async def count() -> None:
        while True:
            data = await sub.receive_some(1 << 20)
            if not data:
                raise RuntimeError("broker closed the benchmark subscriber (slow consumer?)")
            received[0] += len(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count)
        if mode == "hsp-ack":
            nursery.start_soon(read_acks)
            nursery.start_soon(publish_acked)
        else:
            nursery.start_soon(publish_data)
        await trio.sleep(warmup)
        b0, t0, c0 = received[0], time.perf_counter(), broker.cpu_seconds()
        await trio.sleep(seconds)
        b1, t1, c1 = received[0], time.perf_counter(), broker.cpu_seconds()
        nursery.cancel_scope.cancel()
    await sub.aclose()
    await pub.aclose()
    dt = t1 - t0
    rate = (b1 - b0) / delivered_size / dt
    cpu = (c1 - c0) / dt if c0 is not None and c1 is not None else None
    return Result(f"{mode} 1->1", rate, rate, dt, cpu)


async def main(args: argparse.Namespace) -> None:
    with Broker() as broker:
        print(f"broker at {broker.addr['skan']} / hsp {broker.addr['hsp']}; "
              f"{args.seconds:.0f}s per run, {args.rounds} rounds, {PAYLOAD}-byte messages")
        rates: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            native = await throughput(broker.addr["skan"], 1, 1, args.seconds, broker,
                                      label="skan 1->1")
            print(native.line(), flush=True)
            rates.setdefault("skan", []).append(native.msgs_per_s)
            for mode in ("hsp-data", "hsp-ack", "hsp->hsp"):
                result = await hsp_throughput(broker, mode, args.seconds)
                print(result.line(), flush=True)
                rates.setdefault(mode, []).append(result.msgs_per_s)
        skan = statistics.median(rates["skan"])
        print("medians:")
        for mode, values in rates.items():
            med = statistics.median(values)
            print(f"  {mode:<9} {med:>12,.0f} msgs/s  {med / skan:5.2f} x native Skan 1->1")
        ratio = statistics.median(rates["hsp-data"]) / skan
        verdict = "meets" if ratio >= 0.5 else "MISSES"
        print(f"Skan-over-HSP publishing = {ratio:.2f} x native Skan 1->1 "
              f"({verdict} the >= 0.5 target)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
