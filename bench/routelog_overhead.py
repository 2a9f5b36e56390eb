"""Cost of the routing log: the foundation 1->1 and 1->10 rates with [log] enabled and disabled.

    python -m bench.routelog_overhead                  # 3 rounds of 5 s per case
    python -m bench.routelog_overhead --rounds 5 --seconds 8
    python -m bench.routelog_overhead --rounds 0       # in-process part only

First, in-process and free of socket noise: the transport's per-chunk work
(split, decode, route, queue, end the batch) on 256 KiB chunks of 100-byte
messages, with and without the routing log attached (its observer formats
every record; its writer thread writes them to a temporary directory).  The
time counted runs until the writer has written every record, so the thread's
share of the GIL is included.  Best of interleaved runs.

Then end to end: each round starts one broker with the log on and one with it
off and runs both scenarios on each, alternating, so machine noise (other
jobs on this 2-core box) hits both sides alike.  Prints the median of the
rounds, as a rate and as a rate per broker CPU-second (far less sensitive to
other load), and the drop; the target is at most 25 %.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import trio

from bench.onoff import compare, fan_out, in_process, parse_args, route_chunk
from broker.core.router import Router
from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.writer import RoutingLog

ON = "[log]\nenabled = true\n"
OFF = "[log]\nenabled = false\n"


def chunk_cost(subscribers: int, log: bool, chunks: int = 40) -> float:
    """Seconds per message for ``chunks`` 256 KiB chunks, writer caught up at the end."""
    router = Router()
    routelog = None
    if log:
        directory = LogDirectory(tempfile.mkdtemp(prefix="skan-routelog-bench-"), 1)
        directory.open()
        routelog = RoutingLog(directory, rotate_bytes=64 << 20, rotate_seconds=60.0,
                              queue_records=200_000)
        routelog.attach(router)
        routelog.start()

    pub, subs, chunk, per_chunk = fan_out(router, subscribers)
    start = time.perf_counter()
    for _ in range(chunks):
        for conn in (pub, *subs):
            conn.queue.take_all()
        route_chunk(router, pub, chunk)
    if routelog is not None:
        routelog.handoff()
        while routelog.queued:
            time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    if routelog is not None:
        routelog.stop()
        routelog.join()
    return elapsed / (chunks * per_chunk)


async def main(args: argparse.Namespace) -> None:
    in_process("log", chunk_cost, rounds=7, note=", writer caught up")
    if args.rounds:
        await compare("log", ON, OFF, args)


if __name__ == "__main__":
    trio.run(main, parse_args(__doc__))
