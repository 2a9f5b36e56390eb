"""The store's bounds with large messages, on a real broker process (docs/store.md).

    python -m bench.store_bounds [--before TREE]

1. Disk: ``[retention] max_bytes = 8 MiB``, 400 messages of 64 KiB sent
   one per millisecond; the store directory's allocated size (database,
   WAL, shm: ``st_blocks``) sampled every 2 ms; prints the peak beside
   ``max_bytes`` (target: <= 2x), the end size, the eviction count and
   whether the newest message is the last one sent (an Eventer query).
2. Memory: ``max_bytes = 64 MiB``, 150 frames of 4 MiB to a group nobody
   subscribes to; the broker's RSS (``/proc/PID/status`` VmRSS, its store
   writer process's included) before,
   at its peak and 5 s after the last frame (targets: growth < 200 MiB at
   the peak, < 100 MiB 5 s later).

``--before TREE`` runs the same against another checkout (built in place)
in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import threading
import time

import trio

from bench.skan_load import Broker
from clients.skan import SkanClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _allocated(directory: pathlib.Path) -> int:
    total = 0
    for name in os.listdir(directory):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(directory / name).st_blocks * 512
    return total


def _rss_one(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _rss(pid: int) -> int:
    """The broker's RSS plus its children's (the store's writer process)."""
    total = _rss_one(pid)
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for kid in (task / "children").read_text().split():
                with contextlib.suppress(OSError, RuntimeError):
                    total += _rss_one(int(kid))
    return total


class _Sampler:
    def __init__(self, read, interval: float) -> None:
        self.read, self.interval = read, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def disk_run(root: pathlib.Path, label: str, count: int = 400, size: int = 64 * 1024,
                   max_bytes: int = 8 * MiB, extra: str = "") -> None:
    config = f"[retention]\nmax_bytes = {max_bytes}\n[log]\nenabled = false\n{extra}"
    with Broker(config, root=root) as broker:
        assert broker.work is not None
        store = broker.work / "store"
        with _Sampler(lambda: _allocated(store), 0.002) as sampler:
            async with SkanClient.connect(*broker.addr["skan"]) as pub:
                for _i in range(count):
                    await pub.send("big", b"x" * size)
                    await trio.sleep(0.001)
                await pub.barrier()
            await trio.sleep(0.5)
        end = _allocated(store)
        newest = await _newest_seq(broker)
    print(f"{label}: store files peak {sampler.peak / MiB:.1f} MiB allocated "
          f"({sampler.peak / max_bytes:.2f}x max_bytes {max_bytes / MiB:.0f} MiB), "
          f"end {end / MiB:.1f} MiB; {count} x {size // 1024} KiB sent; newest retained: "
          f"{newest}")


async def _newest_seq(broker: Broker) -> str:
    """The newest retained event and the retained count, as an Eventer client sees them."""
    from toolkit.eventer_client import EventerClient
    from wire.eventer import QueryTimeseriesParams

    async with EventerClient.connect(*broker.addr["eventer"]) as ev:
        newest = await ev.query(QueryTimeseriesParams(max_results=1))
        every = await ev.query(QueryTimeseriesParams())
    if not newest.events:
        return "none"
    return f"{newest.events[0].id} ({len(every.events)} retained)"


async def memory_run(root: pathlib.Path, label: str, count: int = 150, size: int = 4 * MiB,
                     max_bytes: int = 64 * MiB, extra: str = "") -> None:
    config = (f"[retention]\nmax_bytes = {max_bytes}\n[broker]\nmax_frame = {size + 4096}\n"
              f"queue_limit = {2 * size + 8192}\n{extra}")
    with Broker(config, root=root) as broker:
        assert broker.proc is not None
        pid = broker.proc.pid
        await trio.sleep(0.5)
        base = _rss(pid)
        payload = b"x" * size
        with _Sampler(lambda: _rss(pid), 0.005) as sampler:
            async with SkanClient.connect(*broker.addr["skan"]) as pub:
                for _ in range(count):
                    await pub.send("unread", payload)
                await pub.barrier()
            await trio.sleep(5.0)
        after = _rss(pid)
    print(f"{label}: RSS {base / MiB:.0f} MiB before, peak +{(sampler.peak - base) / MiB:.0f} "
          f"MiB, +{(after - base) / MiB:.0f} MiB 5 s after {count} x {size // MiB} MiB frames "
          f"(max_bytes {max_bytes // MiB} MiB)")


async def main(before: pathlib.Path | None, rounds: int, writers: bool) -> None:
    trees = [(ROOT, "this tree", "")] + ([(before, "before", "")] if before else [])
    if writers:  # each [store] writer of this tree, side by side
        trees += [(ROOT, f"writer {w}", f'[store]\nwriter = "{w}"\n')
                  for w in ("thread", "process")]
    for _ in range(rounds):
        for root, label, extra in trees:
            await disk_run(root, label, extra=extra)
    for _ in range(rounds):
        for root, label, extra in trees:
            await memory_run(root, label, extra=extra)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=pathlib.Path, help="another checkout, built in place")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--writers", action="store_true",
                    help="also run each [store] writer (thread, process)")
    args = ap.parse_args()
    trio.run(main, args.before, args.rounds, args.writers)
