"""The store's files stay within 2x [retention] max_bytes (WAL and shm included) at every
moment of a run of large messages, paced or in one burst; the newest stay queryable and
every eviction is counted."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from broker.core.router import Endpoint, Router
from broker.store import Store
from wire.skan import decode_header, encode_frame

MiB = 1 << 20


class Sender(Endpoint):
    protocol = "test"

    def deliver(self, frame, routed):  # pragma: no cover - never a recipient
        raise AssertionError


def allocated(directory: str) -> int:
    """Bytes the store's files take on disk (allocated blocks: database, WAL, shm)."""
    total = 0
    for name in os.listdir(directory):
        # (the WAL may go between the listing and the stat)
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(directory, name)).st_blocks * 512
    return total


@pytest.mark.parametrize("paced", [True, False], ids=["paced", "burst"])
def test_files_stay_within_twice_max_bytes_with_64_kib_messages(tmp_path, paced):
    directory = str(tmp_path / "store")
    max_bytes, count, size = 8 * MiB, 400, 64 * 1024
    router = Router()
    store = Store(directory, size=100_000, max_bytes=max_bytes, max_age=0.0,
                  flush_interval=0.005)
    store.attach(router)
    store.start()
    sender = Sender()
    router.attach(sender)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], allocated(directory))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for i in range(count):
            frame = encode_frame({"type": "send", "from": sender.lname, "to": "*",
                                  "group": "big", "instance": "*", "seq": str(i),
                                  "msg": bytes([i % 256]) * size})
            router.route(sender, frame, decode_header(frame, 4))
            router.end_batch()
            if paced:
                time.sleep(0.001)
        store.flush()
        time.sleep(0.05)
    finally:
        done.set()
        sampler.join()
    try:
        assert 0 < peak[0] <= 2 * max_bytes, f"peak {peak[0] / MiB:.1f} MiB"
        assert allocated(directory) <= 2 * max_bytes
        # Eviction kept the newest that fit and counted the others.
        assert store.count * size <= max_bytes < (store.count + 1) * (size + 200)
        assert store.stats.evicted == count - store.count > 0
        newest = store.newest()
        assert newest is not None and newest.header[b"seq"] == str(count - 1).encode()
        seqs = [int(r.header[b"seq"]) for r in store.after(0, 0)]
        assert seqs == list(range(count - store.count, count))
    finally:
        store.close()


def test_the_wal_is_reused_in_place_between_checkpoints(tmp_path):
    """SQLite restarts the WAL after its own checkpoint and overwrites the file: the
    writer does not truncate it to zero at every cycle (every commit's fsync then grew
    the file, which costs more than overwriting), and the file stays within twice the
    cycle.  200 commits of 100 small messages pass the 256 KiB cycle many times."""
    directory = str(tmp_path / "store")
    router = Router()
    store = Store(directory, size=100_000, max_bytes=2 * MiB, max_age=0.0,
                  flush_interval=0.005)
    store.attach(router)
    sender = Sender()
    router.attach(sender)
    wal = os.path.join(directory, "store.sqlite3-wal")
    sizes = []
    try:
        for _ in range(200):
            for i in range(100):
                frame = encode_frame({"type": "send", "from": sender.lname, "to": "*",
                                      "group": "small", "instance": "*", "seq": str(i),
                                      "msg": "x" * 100})
                router.route(sender, frame, decode_header(frame, 4))
                router.end_batch()  # an independent publisher's write: a batch each
            store.flush()
            sizes.append(os.stat(wal).st_size)
        cycle = store.wal_bytes
        first_full = next(i for i, s in enumerate(sizes) if s >= cycle)
        assert sizes.count(0) == 0 and min(sizes[first_full:]) >= cycle, sizes
        assert max(sizes) <= 2 * cycle + 256 * 1024, sizes
        assert store.stats.checkpoints == 0  # no forced truncation was needed
        assert store.count + store.stats.evicted == 20_000  # each kept or evicted
    finally:
        store.close()
