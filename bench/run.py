"""The broker against Mosquitto and NATS, interleaved in one run (see bench/compare.py).

    make bench                                   # skan, mosquitto, nats; default settings
    python -m bench.run --rounds 3 --seconds 5
    python -m bench.run --before ../old-checkout # adds a broker running older code
    python -m bench.run --pure                   # adds a broker with SKAN_PURE_PYTHON=1
    python -m bench.run --bare                   # adds a broker with log, metrics, retention off
    python -m bench.run --feature-costs          # adds one broker per feature turned off
    python -m bench.run --variant 'flush25=[store]\nflush_interval = 0.025'
                                                 # adds a broker with these settings too
    python -m bench.run --broker 127.0.0.1:9912  # a Skan broker that is already running

Scenarios (100-byte payloads): 1->1, 1->10, 10->1 (one group), 100->100 (100
groups, one publisher and one subscriber each), latency p50/p99 and broker
CPU per message at a fixed rate in two traffic shapes ("latency": bursts of
10 every millisecond from one publisher; "isolated": 10 publishers taking
turns, one message per write, every 100 us), and resident memory per idle
connection with 10,000 connections open.
Mosquitto and NATS are the Debian packages, installed when missing.

After the table, each round's own ratio of the latency p99 and CPU to NATS
(and of the default broker to each --feature-costs broker) with their
median: a round's pair was measured in turn, so these move less with the
machine than the ratio of two medians.

Targets (issue 13, ratios in the same run): 1->1 >= 1.5x Mosquitto, 1->10 >=
5x Mosquitto, 10->1 >= 1.5x Mosquitto, p99 <= 1.5x NATS at 10,000 msgs/s;
issue 25: the same p99 target for isolated messages too, store-on p99 <=
1.25x store-off (--feature-costs gives skan-nostore), CPU per message
(isolated, 10,000 msgs/s) <= NATS's.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

import trio

from bench.anchors import Mosquitto, MqttClient, Nats, NatsClient
from bench.compare import LATENCY_SHAPES, SCENARIOS, Target, run
from bench.skan_load import Broker, SkanClient

# The per-message features, each off on its own (--feature-costs) and all
# off (--bare): what they cost, side by side.  Permissions have their own
# benchmark (bench/auth_overhead.py: it needs clients with credentials).
FEATURES_OFF = {
    "log": "\n[log]\nenabled = false\n",
    "metrics": "\n[metrics]\nenabled = false\n",
    "retention": "\n[retention]\nsize = 0\n",
    "store": "\n[store]\nenabled = false\n",
}
BARE = "".join(FEATURES_OFF.values())
# Not a feature but the scheduler hints (broker/serving/scheduling.py): a
# broker without them, beside the rest, shows what they buy.
FEATURES_OFF["hints"] = "\n[broker]\nrouting_slice = 0\nwriter_nice = 0\n"
# ... and the writers' lower priority alone.
FEATURES_OFF["nice"] = "\n[broker]\nwriter_nice = 0\n"
# Nor is the host loop (broker/serving/hostloop.py): a broker under plain
# trio.run, every read through a task, shows what routing from the loop buys.
FEATURES_OFF["hostloop"] = "\n[broker]\nhost_loop = false\n"


async def main(args: argparse.Namespace) -> None:
    config = pathlib.Path(args.config).read_text() if args.config else ""
    scenarios = args.scenarios.split(",")
    for s in scenarios:
        if s not in LATENCY_SHAPES and s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}, "
                             f"{', '.join(LATENCY_SHAPES)}")
    with contextlib.ExitStack() as stack:
        targets: list[Target] = []

        def skan(name: str, broker: Broker) -> None:
            b = stack.enter_context(broker)
            targets.append(Target(name, SkanClient(b, name), b.cpu_seconds,
                                  b.rss if b.proc is not None else None))

        if args.broker:
            host, _, port = args.broker.rpartition(":")
            skan("skan", Broker(config, (host, int(port))))
        else:
            skan("skan", Broker(config))
        if args.before:
            skan("skan-before", Broker(config, root=pathlib.Path(args.before).resolve()))
        if args.feature_costs:
            wanted = FEATURES_OFF if args.feature_costs == "all" else args.feature_costs.split(",")
            for feature in wanted:
                skan(f"skan-no{feature}", Broker(config + FEATURES_OFF[feature]))
        if args.store_writers:
            for writer in ("thread", "process"):
                skan(f"skan-store{writer}",
                     Broker(config + f'\n[store]\nwriter = "{writer}"\n'))
        for name, toml in args.variant:
            skan(f"skan-{name}", Broker(config + "\n" + toml + "\n"))
        if args.bare:
            skan("skan-bare", Broker(config + BARE))
        if args.pure:
            skan("skan-pure", Broker(config, env={"SKAN_PURE_PYTHON": "1"}))
        if not args.no_anchors:
            m = stack.enter_context(Mosquitto())
            targets.append(Target("mosquitto", MqttClient(m), m.cpu_seconds, m.rss))
            n = stack.enter_context(Nats())
            targets.append(Target("nats", NatsClient(n), n.cpu_seconds, n.rss))
        print(f"targets: {', '.join(t.name for t in targets)}; {args.rounds} round(s), "
              f"{args.seconds:.0f}s per case, 100-byte payloads", flush=True)
        await run(targets, scenarios, args.rounds, args.seconds, args.rate,
                  args.latency_seconds, not args.no_memory)


def _variant(text: str) -> tuple[str, str]:
    """``NAME=TOML`` of --variant: the broker's name and its extra settings."""
    name, sep, toml = text.partition("=")
    if not sep or not name or not toml:
        raise argparse.ArgumentTypeError(f"expected NAME=TOML, got {text!r}")
    return name, toml.replace("\\n", "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--broker", help="HOST:PORT of a running Skan broker (default: start one)")
    p.add_argument("--config", help="TOML config for the Skan broker(s) this benchmark starts")
    p.add_argument("--before", help="another checkout of this repository: also run its broker")
    p.add_argument("--pure", action="store_true",
                   help="also run a broker in pure-Python mode (SKAN_PURE_PYTHON=1)")
    p.add_argument("--bare", action="store_true",
                   help="also run a broker with routing log, metrics and retention off")
    p.add_argument("--feature-costs", nargs="?", const="all", default="",
                   help="also run one broker per feature turned off (all, or a list such "
                   f"as 'store,log'; features: {', '.join(FEATURES_OFF)})")
    p.add_argument("--store-writers", action="store_true",
                   help="also run a broker with each [store] writer (thread, process)")
    p.add_argument("--variant", action="append", default=[], type=_variant, metavar="NAME=TOML",
                   help="also run a broker named skan-NAME with these settings added to the "
                   "config (\\n between lines); repeatable")
    p.add_argument("--no-anchors", action="store_true", help="skip Mosquitto and NATS")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the 10,000 idle connections memory figure")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per case")
    p.add_argument("--latency-seconds", type=float, default=5.0)
    p.add_argument("--rate", type=int, default=10_000, help="latency scenario rate, msgs/s")
    p.add_argument("--scenarios", default="1->1,1->10,10->1,100->100,latency,isolated",
                   help="latency: bursts of rate/1000 every 1 ms from one publisher; isolated: "
                   "10 publishers, one message per write, evenly spaced")
    return p.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
