"""How much the store's and the log's writer threads take from the routing thread.

    python -m bench.writer_interference [--before TREE] [--rounds 3] [--seconds 5]

In one process, like the broker: a routing thread routes isolated messages
(one routing batch each, 100-byte payloads) at ``--rate`` msgs/s, sleeping
between them as the broker sleeps in epoll, while the store's and/or the
routing log's writer threads do their work.  For each message it records
how late it finished routing (the time from when it was due until its
observers were done): the wait for the interpreter lock and the CPU the
writers take show up here and nowhere else.  Also the process's CPU per
message (all threads).  Variants: nothing attached, store (writer thread), store-process (the
writer in a child process, broker/store/writer_process.py; its CPU is
counted with the process's), log, both;
``--before TREE`` runs the same variants with another checkout's code
(interleaved, each variant in its own process).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# "log-jsonl": the routing log in its JSON Lines format (this tree only).
VARIANTS = ("none", "store", "store-process", "log", "store+log")


def isolated_publishers(router: object, publishers: int = 10) -> list[tuple]:
    """Ten publishers and one subscriber of group g on ``router``; per publisher its
    (endpoint, frame, header) of a 100-byte send (bench/store_row_cost.py uses it too)."""
    from broker.core.router import NORMAL, Endpoint
    from wire.skan import decode_header, encode_frame

    class Sink(Endpoint):
        protocol = "skan"

        def deliver(self, frame: bytes, routed: object) -> None:
            pass

    pubs = [Sink() for _ in range(publishers)]
    sub = Sink()
    for p in pubs:
        router.attach(p)
    router.attach(sub)
    router.subscribe(sub, b"g", b"*", NORMAL)
    frames = [(p, encode_frame({"type": "send", "from": p.lname, "to": "*", "group": "g",
                                "instance": "*", "seq": "1", "msg": b"x" * 100})) for p in pubs]
    return [(p, f, decode_header(f, 4)) for p, f in frames]


def child(variant: str, rate: int, seconds: float, nice: int) -> dict:
    from broker.core.router import Router

    work = tempfile.mkdtemp(prefix="skan-interference-")
    router = Router()
    closers = []
    if "store" in variant:
        from broker.serving.scheduling import lower_thread_priority
        from broker.store import Store
        from broker.store.writer_process import ProcessStore

        cls = ProcessStore if "process" in variant else Store
        store = cls(os.path.join(work, "store"), size=100_000, max_bytes=256 << 20,
                      max_age=0.0, flush_interval=0.01)
        store.attach(router)
        if "process" in variant:
            # store-process-samegroup: the child in the broker's session
            # (and so its scheduler autogroup), to tell the two effects apart.
            store.own_session = "samegroup" not in variant
            store.start(nice=nice)
        else:
            store.start(None, functools.partial(lower_thread_priority, nice))
        closers.append(store.close)
    if "log" in variant:
        from broker.observability.routelog.files import LogDirectory
        from broker.observability.routelog.writer import RoutingLog

        d = LogDirectory(os.path.join(work, "log"), 1)
        d.open()
        fmt = {"format": "jsonl"} if variant.endswith("jsonl") else {}
        rl = RoutingLog(d, rotate_bytes=64 << 20, rotate_seconds=60.0, queue_records=200_000,
                        **fmt)
        rl.attach(router)
        rl.start()
        last_handoff = [time.monotonic()]

        def handoff() -> None:  # the service's 50 ms timer
            now = time.monotonic()
            if now - last_handoff[0] >= 0.05:
                last_handoff[0] = now
                rl.handoff()

        closers.append(lambda: (rl.stop(), rl.join()))
    else:
        def handoff() -> None:
            pass

    frames = isolated_publishers(router)
    interval = 1.0 / rate
    late: list[float] = []
    cpu0 = time.process_time()
    start = time.perf_counter()
    k = 0
    while True:
        due = start + k * interval
        now = time.perf_counter()
        if now - start >= seconds:
            break
        if due > now:
            time.sleep(due - now)
        p, f, h = frames[k % 10]
        router.route(p, f, dict(h))
        router.end_batch()
        handoff()
        late.append(time.perf_counter() - due)
        k += 1
    cpu = time.process_time() - cpu0
    own = cpu
    backlog = store.pending() if "store" in variant else 0
    for close in closers:
        close()
    # The writer process's CPU ([store] writer = "process"; its close included).
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += kids.ru_utime + kids.ru_stime
    # Everything, the writers' catching up at close included: a writer thread
    # that fell behind does part of its work after the measured window.
    cpu_all = time.process_time() - cpu0 + kids.ru_utime + kids.ru_stime
    late.sort()
    q = statistics.quantiles(late, n=1000)
    return {"p50": q[499] * 1e3, "p99": q[989] * 1e3, "p999": q[998] * 1e3,
            "cpu_us": cpu / k * 1e6, "own_us": own / k * 1e6,
            "all_us": cpu_all / k * 1e6, "backlog": backlog, "n": k, "rate": k / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=pathlib.Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=int, default=10_000)
    # The store writer's nice increment, as [broker] writer_nice (default 10).
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rate, args.seconds, args.nice)))
        return
    trees = [("this", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for variant in args.variants.split(","):
            for label, tree in trees:
                out = subprocess.run(
                    [sys.executable, str(ROOT / "bench" / "writer_interference.py"),
                     "--child", variant,
                     "--rate", str(args.rate), "--seconds", str(args.seconds),
                     "--nice", str(args.nice)],
                    cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                    capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((variant, label), []).append(res)
                print(f"  round {r + 1} {variant:<9} {label:<6} p50 {res['p50']:.3f} ms  "
                      f"p99 {res['p99']:.3f} ms  p99.9 {res['p999']:.3f} ms  "
                      f"cpu {res['cpu_us']:.1f} us/msg (this process {res['own_us']:.1f}; with "
                      f"close {res['all_us']:.1f}, {res['backlog']} queued at the end)  "
                      f"({res['rate']:,.0f}/s)", flush=True)
    print("\n| variant | tree | p50 ms | p99 ms | p99.9 ms | CPU us/msg | of it this process |")
    print("|---|---|---|---|---|---|---|")
    for (variant, label), rs in results.items():
        med = {k: statistics.median(x.get(k, x["cpu_us"]) for x in rs)
               for k in ("p50", "p99", "p999", "cpu_us", "own_us")}
        print(f"| {variant} | {label} | {med['p50']:.3f} | {med['p99']:.3f} | "
              f"{med['p999']:.3f} | {med['cpu_us']:.1f} | {med['own_us']:.1f} |")


if __name__ == "__main__":
    main()
