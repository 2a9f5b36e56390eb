"""Routing-log retention: oldest complete files removed first, by size and by age, counted."""

from __future__ import annotations

import os
import time

import pytest
import trio

from broker.observability.routelog.files import LogDirectory, final_name
from tests.observability.routelog.test_record import send, sink
from tests.observability.routelog.test_writer import make_log, published, read_all, wait_for


def _file(tmp_path, n: int, size: int, age: float = 0.0, suffix: str = ".parquet") -> str:
    name = final_name(1, 1_700_000_000 + n, n, suffix)
    path = tmp_path / name
    path.write_bytes(b"x" * (size - 1) + b"\n")
    if age:
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))
    return name


def test_prune_by_bytes_removes_oldest_first_and_keeps_the_hidden_file(tmp_path):
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    # Old JSON Lines files count and go like Parquet ones (a directory may hold both).
    names = [_file(tmp_path, n, 1000, suffix=(".jsonl", ".parquet")[n % 2]) for n in range(5)]
    hidden = tmp_path / (".x" + names[0] + ".tmp")
    hidden.write_bytes(b"y" * 5000)
    pruned = d.prune(max_bytes=2500, max_age=0)
    assert (pruned.files, pruned.bytes) == (3, 3000)
    assert published(tmp_path) == names[3:]
    assert hidden.exists()
    assert d.prune(max_bytes=2500, max_age=0).files == 0


def test_prune_by_age(tmp_path):
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    old = [_file(tmp_path, n, 100, age=3600) for n in range(2)]
    young = [_file(tmp_path, n, 100) for n in range(2, 4)]
    pruned = d.prune(max_bytes=0, max_age=60)
    assert pruned.files == 2 and not set(old) & set(published(tmp_path))
    assert published(tmp_path) == young


def test_no_limits_remove_nothing(tmp_path):
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    for n in range(3):
        _file(tmp_path, n, 100, age=10 ** 6)
    assert d.prune(max_bytes=0, max_age=0).files == 0
    assert len(published(tmp_path)) == 3


def test_writer_applies_retention_after_each_file_and_counts(tmp_path):
    router, rl = make_log(tmp_path, rotate_bytes=4000, queue_records=40, max_bytes=9000,
                          format="jsonl")
    rl.start()
    pub = sink(router)
    for i in range(300):
        send(router, pub, seq=str(i).encode())
        if i % 10 == 9:
            wait_for(lambda: rl.queued == 0)
    rl.stop()
    rl.join()
    names = published(tmp_path)
    total = sum((tmp_path / n).stat().st_size for n in names)
    assert total <= 9000 and rl.stats.pruned_files == rl.stats.files - len(names) > 0
    assert rl.stats.pruned_bytes > 0
    # What is left is the newest records, complete and in order.
    seqs = [int(r["seq"]) for r in read_all(tmp_path)]
    assert seqs == list(range(seqs[0], 300))


def test_writer_prunes_at_start(tmp_path):
    for n in range(3):
        _file(tmp_path, n, 100, age=7200)
    _router, rl = make_log(tmp_path, max_age=3600)
    rl.start()
    wait_for(lambda: rl.stats.pruned_files == 3)
    rl.stop()
    rl.join()
    assert published(tmp_path) == []


@pytest.mark.trio
async def test_retention_is_exported_in_metrics():
    """``skan_routelog_pruned_*`` count what retention removed (a real broker)."""
    from clients.skan import SkanClient
    from tests.brokerproc import BrokerProcess
    from tests.observability.metrics.httpc import scrape, value

    config = '[log]\nrotate_bytes = 2000\nmax_bytes = 5000\nformat = "jsonl"\n'
    with BrokerProcess(config) as broker:
        async with SkanClient.connect(*broker.skan) as c:
            for i in range(400):
                await c.send("ret", "x" * 50)
                if i % 50 == 49:
                    await c.barrier()
                    await trio.sleep(0.1)  # the writer completes files as it goes
        with trio.fail_after(10):
            while True:
                data = await scrape(broker.addr["metrics"])
                if value(data, "skan_routelog_pruned_files_total") > 0:
                    break
                await trio.sleep(0.2)
        assert value(data, "skan_routelog_pruned_bytes_total") > 0
