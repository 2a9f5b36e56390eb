"""Foundation benchmark: 1->1, 1->10, 10->1 throughput and p50/p99 latency at 10k msgs/s.

    make bench                         # starts its own broker with default settings
    python -m bench.run --broker 127.0.0.1:9912   # a broker that is already running
    python -m bench.run --config my.toml --seconds 10

Targets (issue 2, 100-byte messages, this 2-core machine): >= 150,000 msgs/s
1->1, >= 600,000 deliveries/s 1->10, p99 <= 1 ms at 10k msgs/s.
"""

from __future__ import annotations

import argparse
import pathlib

import trio

from bench.skan_load import Broker, latency, throughput

SCENARIOS = {"1-1": (1, 1), "1-10": (1, 10), "10-1": (10, 1)}


async def main(args: argparse.Namespace) -> None:
    config = pathlib.Path(args.config).read_text() if args.config else ""
    address = None
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        address = (host, int(port))
    with Broker(config, address) as broker:
        addr = broker.addr["skan"]
        print(f"broker at {addr[0]}:{addr[1]}; {args.seconds:.0f}s per scenario, "
              f"{100}-byte messages")
        for name in args.scenarios.split(","):
            if name == "latency":
                p50, p99, n = await latency(addr, args.rate, args.seconds)
                print(f"latency  at {args.rate:,} msgs/s: p50 {p50:.3f} ms  p99 {p99:.3f} ms "
                      f"({n:,} samples)")
            else:
                pubs, subs = SCENARIOS[name]
                result = await throughput(addr, pubs, subs, args.seconds, broker)
                print(result.line(), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--broker", help="HOST:PORT of a running broker (default: start one)")
    p.add_argument("--config", help="TOML config for the broker this benchmark starts")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=int, default=10_000, help="latency scenario rate")
    p.add_argument("--scenarios", default="1-1,1-10,10-1,latency")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
