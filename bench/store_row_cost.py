"""The store writer's CPU per message, by how many messages one routing batch holds.

    python -m bench.store_row_cost [--per-commit 100] [--commits 300] [--batch 1]

In one thread, no broker: ``--per-commit`` messages (100-byte payloads, ten
publishers, one group and type) are routed through the real router, each
routing batch holding ``--batch`` of them, and the store's writer then
commits what they queued; repeated ``--commits`` times.  Prints the routing
thread's cost per message (route, end_batch, the store's observer) and the
commit's user and system CPU per message and per commit
(``getrusage(RUSAGE_THREAD)`` around ``_commit_queued``).

Isolated messages (``--batch 1``: each its own routing batch, hence its own
session and its own row in ``runs``) against bursts (``--batch 10`` or more:
one row per batch) show what a row costs SQLite (docs/store.md, "Keeping
routing's latency").  At 10,000 msgs/s and the default flush_interval a
commit holds about 100 messages, the default here.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-commit", type=int, default=100)
    p.add_argument("--commits", type=int, default=300)
    p.add_argument("--batch", type=int, default=1, help="messages per routing batch")
    args = p.parse_args()

    from bench.writer_interference import isolated_publishers
    from broker.core.router import Router
    from broker.store import Store

    work = tempfile.mkdtemp(prefix="skan-row-cost-")
    try:
        router = Router()
        store = Store(os.path.join(work, "store"), size=10_000_000, max_bytes=0, max_age=0.0,
                      flush_interval=0.01)
        store.attach(router)
        frames = isolated_publishers(router)

        def thread_cpu() -> tuple[float, float]:
            r = resource.getrusage(resource.RUSAGE_THREAD)
            return r.ru_utime, r.ru_stime

        route_s = user_s = sys_s = 0.0
        k = 0
        for _ in range(args.commits):
            t0 = time.perf_counter()
            for i in range(args.per_commit):
                pub, frame, header = frames[k % len(frames)]
                k += 1
                router.route(pub, frame, header)
                if (i + 1) % args.batch == 0:
                    router.end_batch()
            router.end_batch()
            route_s += time.perf_counter() - t0
            u0, s0 = thread_cpu()
            with store._lock:
                store._commit_queued()
            u1, s1 = thread_cpu()
            user_s += u1 - u0
            sys_s += s1 - s0
        n = args.per_commit * args.commits
        print(f"batch {args.batch}, {args.per_commit} messages a commit, {args.commits} commits "
              f"({store.stats.commits} made)")
        print(f"  routing thread (route, end_batch, observer): {route_s / n * 1e6:.1f} us/msg")
        print(f"  commit: user {user_s / n * 1e6:.1f} + system {sys_s / n * 1e6:.1f} us/msg "
              f"= {(user_s + sys_s) / args.commits * 1e3:.2f} ms a commit")
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
