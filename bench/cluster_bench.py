"""Cluster benchmark: brokers joined by a real nats-server, against one broker, in one run.

Prints, for 100-byte messages:
- single: 1->1 and 1->10 on one broker without a cluster (the reference);
- local, cluster on: the same on one broker of a two-broker cluster, with
  publishers and subscribers on that broker (the cost of cluster mode on
  broker-local traffic: since interest announcements, nothing is published
  to NATS when no other broker wants the group);
- cross: publishers on broker A, subscribers on broker B (through NATS).
Ratios are against ``single`` in the same run (the machine's speed moves by
2x between phases: only same-run ratios mean something).  The last columns
are CPU time per routed message (microseconds): of the brokers, and of the
brokers plus nats-server; on a shared machine they move less than rates do.

    python -m bench.cluster_bench [--seconds 5]
    python -m bench.cluster_bench --before ../old-checkout [--rounds 2]
    python -m bench.cluster_bench --visibility [--nodes 3] [--before ../old-checkout]
    python -m bench.cluster_bench --in-process [--before ../old-checkout]

``--before`` runs the same rows from another source tree, interleaved round
by round, the trees in alternating order (each tree's rows against its own
single broker).  ``--visibility``
measures how long a subscription made on broker B takes to receive the
messages a publisher on broker A sends every 0.5 ms (from B confirming the
subscribe to the first message), through one NATS server or, with
``--nodes 3``, with A and B on different nodes of a three-node NATS cluster.
``--in-process`` times, without sockets, the CPU per message of a 1->1
crossing's pieces (:func:`in_process`): the single broker's routing
with its store, the publishing broker's backplane observer (published and
withheld), and the receiving broker's whole path for the runs it produced.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import attrs
import trio

from bench.anchors import proc_cpu_seconds
from bench.skan_load import (
    BATCH,
    PAYLOAD,
    ROOT,
    Broker,
    Result,
    raw_connect,
    send_frame,
    subscribe,
)
from clients.skan import SkanClient
from tests.cluster.natsproc import NatsCluster, NatsNode


@attrs.define
class Row:
    tree: str
    mode: str
    result: Result
    # CPU seconds per routed message: the brokers, and the brokers plus NATS.
    broker_cpu: float
    total_cpu: float


def cpu(pids: list[int]) -> float:
    return sum(proc_cpu_seconds(pid) for pid in pids)


async def flow(pub_addr: tuple[str, int], sub_addr: tuple[str, int], subscribers: int,
               seconds: float, label: str, warmup: float = 1.5,
               pids: tuple[list[int], list[int]] = ([], [])) -> tuple[Result, float, float]:
    """One publisher on ``pub_addr`` floods a group; subscribers on ``sub_addr`` count bytes.

    Returns the result and the CPU seconds per routed message of the
    processes ``pids`` names (brokers, then the others: nats-server)."""
    group = f"cb-{subscribers}-{time.monotonic_ns()}"
    subs = [await subscribe(sub_addr, group) for _ in range(subscribers)]
    stream, lname = await raw_connect(pub_addr)
    frame = send_frame(lname, group, b"x" * PAYLOAD)
    received = [0] * subscribers
    out: dict[str, float] = {}

    async def publish() -> None:
        buf = frame * BATCH
        while True:
            await stream.send_all(buf)

    async def count(i: int, s: trio.SocketStream) -> None:
        while True:
            data = await s.receive_some(1 << 20)
            if not data:
                raise RuntimeError("a benchmark subscriber was closed (slow consumer?)")
            received[i] += len(data)

    await trio.sleep(0.5)  # the group's interest reaches NATS
    async with trio.open_nursery() as nursery:
        for i, s in enumerate(subs):
            nursery.start_soon(count, i, s)
        nursery.start_soon(publish)
        await trio.sleep(warmup)
        b0, t0 = sum(received), time.perf_counter()
        c0 = (cpu(pids[0]), cpu(pids[1]))
        await trio.sleep(seconds)
        out["bytes"], out["dt"] = sum(received) - b0, time.perf_counter() - t0
        out["brokers"], out["others"] = cpu(pids[0]) - c0[0], cpu(pids[1]) - c0[1]
        nursery.cancel_scope.cancel()
    for s in [*subs, stream]:
        await s.aclose()
    deliveries = out["bytes"] / len(frame) / out["dt"]
    messages = max(out["bytes"] / len(frame) / subscribers, 1.0)
    return (Result(label, deliveries / subscribers, deliveries, out["dt"]),
            out["brokers"] / messages, (out["brokers"] + out["others"]) / messages)


QUIET = "[log]\nenabled = false\n"


def cluster_config(server_id: int, url: str) -> str:
    return (f"[broker]\nserver_id = {server_id}\n[cluster]\nurl = \"{url}\"\n"
            "id_probe_timeout = 0.3\n" + QUIET)


def pid(process: Broker | NatsNode) -> int:
    assert process.proc is not None
    return process.proc.pid


async def tree_rows(tree: str, root: pathlib.Path, seconds: float) -> list[Row]:
    """single, local and cross rows, 1->1 and 1->10, from the source tree ``root``."""
    rows: list[Row] = []

    async def row(mode: str, pub: tuple[str, int], sub: tuple[str, int], subscribers: int,
                  label: str, pids: tuple[list[int], list[int]]) -> None:
        rows.append(Row(tree, mode, *await flow(pub, sub, subscribers, seconds, label,
                                                pids=pids)))

    with Broker(QUIET, root=root) as single:
        addr = single.addr["skan"]
        for n in (1, 10):
            await row("single", addr, addr, n, f"1->{n}", ([pid(single)], []))
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with (Broker(cluster_config(1, url), root=root) as a,
              Broker(cluster_config(2, url), root=root) as b):
            aa, ba = a.addr["skan"], b.addr["skan"]
            pids = ([pid(a), pid(b)], [pid(nats.nodes[0])])
            for n in (1, 10):
                await row("local", aa, aa, n, f"1->{n}", pids)
            for n in (1, 10):
                await row("cross", aa, ba, n, f"1->{n}", pids)
    return rows


async def main(seconds: float, trees: dict[str, pathlib.Path], rounds: int) -> None:
    print(f"{'round':<6}{'tree':<8}{'mode':<8}{'scenario':<8}{'deliveries/s':>16}"
          f"{'vs single':>12}{'brokers us/msg':>16}{'+nats us/msg':>14}")
    for i in range(rounds):
        # Alternate which tree goes first: the machine's state drifts within a round.
        order = list(trees.items())[::-1 if i % 2 else 1]
        for tree, root in order:
            rows = await tree_rows(tree, root, seconds)
            ref = {r.result.scenario: r.result.deliveries_per_s
                   for r in rows if r.mode == "single"}
            for r in rows:
                rate, scenario = r.result.deliveries_per_s, r.result.scenario
                print(f"{i + 1:<6}{r.tree:<8}{r.mode:<8}{scenario:<8}{rate:>16,.0f}"
                      f"{rate / ref[scenario]:>11.2f}x"
                      f"{r.broker_cpu * 1e6:>16.2f}{r.total_cpu * 1e6:>14.2f}", flush=True)
            with open("/proc/loadavg") as f:
                print("load average:", f.read().strip(), flush=True)


# Subscriptions measured per tree: enough for a median and a p90.
VISIBILITY_SAMPLES = 20


async def visibility(trees: dict[str, pathlib.Path], nodes: int) -> None:
    """Time from B confirming a subscribe to the first message from A's publisher."""
    with NatsCluster(nodes) as nc:
        for tree, root in trees.items():
            with (Broker(cluster_config(1, nc.nodes[0].url), root=root) as a,
                  Broker(cluster_config(2, nc.nodes[-1].url), root=root) as b):
                await trio.sleep(3.0)  # past the blind window: interest known
                delays = []
                async with (SkanClient.connect(*a.addr["skan"]) as pub,
                            SkanClient.connect(*b.addr["skan"]) as sub):
                    for i in range(VISIBILITY_SAMPLES):
                        group = f"vis-{i}"

                        async def publish(group: str = group) -> None:
                            while True:
                                await pub.send(group, "x")
                                await trio.sleep(0.0005)

                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(publish)
                            await trio.sleep(0.05)
                            await sub.subscribe(group)  # returns when B confirmed it
                            t0 = time.perf_counter()
                            with trio.fail_after(10):
                                await sub.receive()
                            delays.append(time.perf_counter() - t0)
                            nursery.cancel_scope.cancel()
                        await sub.unsubscribe(group)
                        await trio.sleep(0.05)
                        while True:  # what was in flight
                            with trio.move_on_after(0.05):
                                await sub.receive()
                                continue
                            break
            delays.sort()
            ms = [d * 1e3 for d in delays]
            print(f"{tree:<8} nodes={nodes} median {statistics.median(ms):.2f} ms  "
                  f"p90 {ms[int(0.9 * len(ms))]:.2f} ms  max {ms[-1]:.2f} ms", flush=True)
    with open("/proc/loadavg") as f:
        print("load average:", f.read().strip())


# Chunks routed per timing, and timings per figure (the best is kept).
IN_PROCESS_CHUNKS = 20
IN_PROCESS_REPEATS = 7


def in_process(tree: str) -> None:
    """CPU ns per message, in process: a single broker's 1->1 routing (store on),
    the publishing broker's backplane observer, the receiving broker's path."""
    import tempfile

    from bench.onoff import fan_out, route_chunk
    from broker.cluster.backplane import Backplane
    from broker.core.router import Router
    from broker.protocols.skan.listener import SkanEndpoint
    from broker.store import Store
    from tests.cluster.fakenats import parse_commands
    from wire import nats
    from wire.skan import encode_frame

    def router(server_id: int) -> tuple[Router, Callable[[], None]]:
        r = Router(server_id=server_id)
        store = Store(tempfile.mkdtemp(prefix="cluster-bench-"), size=100_000, max_bytes=0,
                      max_age=0.0, flush_interval=0.0)
        store.attach(r)
        r.group_stats = {}

        def commit() -> None:
            with store._lock:
                store._commit_queued()
        return r, commit

    def per_message(step: Callable[[], None], n: int) -> float:
        start = time.thread_time()
        for _ in range(IN_PROCESS_CHUNKS):
            step()
        return (time.thread_time() - start) / (IN_PROCESS_CHUNKS * n) * 1e9

    single, single_commit = router(0)
    s_pub, s_subs, chunk, n = fan_out(single, 1)

    def single_step() -> None:
        s_subs[0].queue.take_all()
        route_chunk(single, s_pub, chunk)
        single_commit()

    # Broker A: its publisher's batches, observed by the backplane alone.
    a = Router(server_id=1)
    batches: list = []
    a.observers.append(batches.append)
    bp_a = Backplane(a, 1)
    a.observers.remove(bp_a.observe)
    a_pub, _, a_chunk, _ = fan_out(a, 0)
    route_chunk(a, a_pub, a_chunk)

    def observe(wanted: set[bytes]) -> Callable[[], None]:
        def step() -> None:
            bp_a.remote.wanted = wanted
            for batch in batches:
                bp_a.observe(batch)
            bp_a.pending.clear()
        return step

    bp_a.pending.clear()
    bp_a.remote.wanted = {b"bench"}
    for batch in batches:
        bp_a.observe(batch)
    msgs = [nats.Msg(args[0], b"1", None, body[int(args[-2]):], body[:int(args[-2])])
            for op, args, body in parse_commands(b"".join(bp_a.pending)) if op == b"HPUB"]
    sent = sum(map(len, batches))

    # Broker B: one subscriber, receiving A's runs (one routing batch per chunk).
    b, b_commit = router(2)
    bp_b = Backplane(b, 2)
    sub = SkanEndpoint(b, 1 << 30, "drop", 8 << 20)
    b.attach(sub)
    sub.on_bytes(encode_frame({"type": "getlname"}))
    sub.on_bytes(encode_frame({"type": "subscribe", "group": "bench", "instance": "*"}))

    def receive() -> None:
        bp_b._hwm.clear()  # the same runs again: not duplicates
        sub.queue.take_all()
        for msg in msgs:
            bp_b.receive(msg)
        b.end_batch()
        b_commit()

    timers = {"single 1->1 routing": (single_step, n),
              "A observer, published": (observe({b"bench"}), sent),
              "A observer, withheld": (observe(set()), sent),
              "B receiving, whole path": (receive, sent)}
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(IN_PROCESS_REPEATS):
        for name, (step, count) in timers.items():
            best[name] = min(best[name], per_message(step, count))
    print(f"{tree:<8}" + "  ".join(f"{name} {ns:,.0f}" for name, ns in best.items())
          + " (ns/msg)", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--before", type=pathlib.Path,
                        help="another source tree to run interleaved (e.g. the previous release)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--visibility", action="store_true")
    parser.add_argument("--nodes", type=int, default=1, help="NATS nodes for --visibility")
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--in-process-child", metavar="TREE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trees = {"this": ROOT}
    if args.before is not None:
        trees["before"] = args.before.resolve()
    if args.in_process_child:
        in_process(args.in_process_child)
    elif args.in_process:
        # This file, run against each tree's modules (PYTHONPATH), in turn.
        for _ in range(args.rounds):
            for tree, root in trees.items():
                subprocess.run([sys.executable, __file__, "--in-process-child", tree],
                               cwd=root, check=True, env={**os.environ, "PYTHONPATH": str(root)})
    elif args.visibility:
        trio.run(visibility, trees, args.nodes)
    else:
        trio.run(main, args.seconds, trees, args.rounds)
