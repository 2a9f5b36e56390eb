"""The routing log of a live broker: every routed message, graceful and killed stops,
back-pressure, disk errors, refusal of an unusable directory."""

from __future__ import annotations

import collections
import os
import resource
import signal
import subprocess
import sys
import threading

import pytest
import trio

from broker.app import lifecycle as app
from broker.serving.config import from_mapping
from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.routelog.logfiles import hidden_files, read_log, visible_files
from wire.skan import encode_frame


def message(c: SkanClient, group: str, seq: int, to: str = "*", size: int = 20) -> dict:
    return {"type": "send", "from": c.lname, "to": to, "group": group, "instance": "*",
            "seq": str(seq), "msg": b"m" * size}


class Ledger:
    """What the test sent: count and bytes per group, each (lname, seq) once."""

    def __init__(self) -> None:
        self.count: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.keys: set[tuple[str, str]] = set()

    async def send(self, c: SkanClient, msg: dict) -> None:
        await c.send_raw(msg)
        self.count[msg["group"]] += 1
        self.bytes[msg["group"]] += len(encode_frame(msg))
        self.keys.add((c.lname, msg["seq"]))


def tally(records: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    count: collections.Counter = collections.Counter()
    size: collections.Counter = collections.Counter()
    for r in records:
        count[r["group"]] += 1
        size[r["group"]] += r["size"]
    return count, size


@pytest.mark.parametrize("fmt, files", [("jsonl", 4), ("parquet", 1)])
async def test_graceful_stop_logs_every_routed_message(tmp_path, fmt, files):
    # Small JSON Lines files: rotation by size runs many times during the test
    # (a Parquet file rotates by size only after a row group: tests/.../test_writer.py).
    b = BrokerProcess(f'[log]\nrotate_bytes = 3000\nformat = "{fmt}"\n',
                      workdir=tmp_path).start()
    ledger = Ledger()
    try:
        async with (
            SkanClient.connect(*b.skan) as pub1,
            SkanClient.connect(*b.skan) as pub2,
            SkanClient.connect(*b.skan) as sub,
        ):
            await sub.subscribe("g1")
            await sub.subscribe("g2")
            await pub2.subscribe("g2")  # a sender never counts as its own recipient
            seq = 0
            for _ in range(50):
                seq += 1
                await ledger.send(pub1, message(pub1, "g1", seq, size=seq))
            for _ in range(30):
                seq += 1
                await ledger.send(pub1, message(pub1, "g2", seq))
            for _ in range(40):
                seq += 1
                await ledger.send(pub2, message(pub2, "g2", seq))
            for _ in range(10):
                seq += 1
                await ledger.send(pub2, message(pub2, "nobody", seq))
            await ledger.send(pub1, message(pub1, "g1", seq + 1, to=sub.lname))
            await pub1.barrier()
            await pub2.barrier()
            stats = await sub.stats()
            lnames = {"pub1": pub1.lname, "pub2": pub2.lname, "sub": sub.lname}
    finally:
        assert b.stop(signal.SIGTERM) == 0, "".join(b.stderr_lines[-20:])
    log_dir = tmp_path / "log"
    assert hidden_files(log_dir) == []
    assert len(visible_files(log_dir)) >= files
    assert all(p.suffix == "." + fmt for p in visible_files(log_dir))
    records = read_log(log_dir)
    count, size = tally(records)
    assert count == ledger.count and size == ledger.bytes
    assert {(r["lname"], r["seq"]) for r in records} == ledger.keys
    assert len(records) == len(ledger.keys) == int(stats["messages_in"])
    by_group = collections.defaultdict(list)
    for r in records:
        by_group[r["group"]].append(r)
    assert all(r["proto"] == "skan" for r in records)
    assert {(r["recipients"]["skan"], r["delivered"]) for r in by_group["g1"]} == {(1, 1)}
    g2_pub2 = [r for r in by_group["g2"] if r["lname"] == lnames["pub2"]]
    g2_pub1 = [r for r in by_group["g2"] if r["lname"] == lnames["pub1"]]
    assert {r["delivered"] for r in g2_pub2} == {1}  # sub only, not pub2 itself
    assert {r["delivered"] for r in g2_pub1} == {2}  # sub and pub2
    assert all(r["undeliverable"] and r["recipients"] == {} for r in by_group["nobody"])
    assert sum(r["undeliverable"] for r in records) == 10 == int(stats["undeliverable"])
    directed = [r for r in by_group["g1"] if r["to"] != "*"]
    assert [r["to"] for r in directed] == [lnames["sub"]]
    times = [r["time_us"] for r in records]
    assert times == sorted(times)


async def send_until_cancelled(addr, sent: list[int]) -> None:
    async with SkanClient.connect(*addr) as c:
        seq = 0
        while True:
            batch = b"".join(encode_frame(message(c, "kill", seq + i)) for i in range(1, 201))
            await c._stream.send_all(batch)
            seq += 200
            sent[0] = seq
            await trio.sleep(0.01)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
async def test_killed_broker_leaves_no_half_file_and_next_start_recovers(tmp_path, fmt):
    b = BrokerProcess(f'[log]\nrotate_seconds = 0.3\nformat = "{fmt}"\n',
                      workdir=tmp_path).start()
    log_dir = tmp_path / "log"
    sent = [0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_until_cancelled, b.skan, sent)
        with trio.fail_after(30):
            while len(visible_files(log_dir)) < 2 or not hidden_files(log_dir):
                await trio.sleep(0.05)
        b.stop(signal.SIGKILL)
        nursery.cancel_scope.cancel()
    assert b.proc.returncode == -signal.SIGKILL
    before = read_log(log_dir)  # every visible file is complete
    (torn,) = hidden_files(log_dir)
    assert torn.stat().st_size > 0 or fmt == "parquet"  # Parquet: written per row group
    # The next broker on this directory publishes the complete lines a JSON
    # Lines file left; a Parquet file without its footer is unreadable: removed.
    b2 = BrokerProcess(f'[log]\nformat = "{fmt}"\n', workdir=tmp_path).start()
    assert b2.stop() == 0
    assert hidden_files(log_dir) == []
    after = read_log(log_dir)
    seqs = [int(r["seq"]) for r in after]
    assert seqs == sorted(set(seqs)) and seqs[-1] <= sent[0]
    if fmt == "jsonl":
        assert len(after) > len(before)
        assert any("published 1 file(s)" in line for line in b2.stderr_lines)
    else:
        assert after == before
        assert any("removed 1 unfinished Parquet file(s)" in line for line in b2.stderr_lines)


class InProcessBroker:
    """``broker.app.lifecycle.run`` in the test's own trio loop, for reaching its components."""

    def __init__(self, log: dict) -> None:
        ports = {s: {"port": 0} for s in ("skan", "hsp", "eventer", "mariner", "metrics")}
        self.config = from_mapping({**ports, "log": log})
        self.stop = trio.Event()
        self.ctx_out: list = []
        self.skan: tuple[str, int] | None = None

    def ready(self, lines: list[str]) -> None:
        for line in lines:
            _, proto, hostport = line.split()
            if proto == "skan":
                host, _, port = hostport.rpartition(":")
                self.skan = (host, int(port))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: app.run(self.config, ready=self.ready, stop=self.stop,
                                               ctx_out=self.ctx_out))
            while self.skan is None:
                await trio.sleep(0.01)
            task_status.started(self.ctx_out[0])


async def test_backpressure_holds_readers_until_the_writer_catches_up(tmp_path):
    broker = InProcessBroker({"dir": str(tmp_path), "queue_records": 8,
                              "when_full": "backpressure"})
    stall = threading.Event()
    async with trio.open_nursery() as nursery:
        ctx = await nursery.start(broker.run)
        rl = ctx.routelog
        gate = ctx.connections.gate
        new_file = rl.directory.new_file

        def stalled_disk():  # the first file cannot be opened until the test says so
            stall.wait()
            return new_file()

        rl.directory.new_file = stalled_disk
        async with SkanClient.connect(*broker.skan) as pub, SkanClient.connect(*broker.skan) as sub:
            await sub.subscribe("bp")
            for i in range(20):
                await pub.send_raw(message(pub, "bp", i))
            while not gate.closed:
                await trio.sleep(0.01)
            await trio.sleep(0.1)
            routed = sub._inbox.statistics().current_buffer_used
            assert 8 < routed <= 20 and rl.queued == routed
            for i in range(20, 120):
                await pub.send_raw(message(pub, "bp", i))
            await trio.sleep(0.3)
            # The broker stopped reading: the later messages wait in TCP buffers.
            assert sub._inbox.statistics().current_buffer_used == routed
            assert gate.closed and rl.stats.backpressure_closes == 1
            assert rl.backpressure_waits >= 1 and rl.queued == routed
            stall.set()
            for i in range(120):
                assert (await sub.receive()).seq == str(i)
            while gate.closed or rl.queued:  # (it may close again while the rest routes)
                await trio.sleep(0.01)
        broker.stop.set()
    assert rl.stats.records == 120 and rl.queued == 0
    assert [r["seq"] for r in read_log(tmp_path)] == [str(i) for i in range(120)]


async def test_writer_failure_stops_the_broker(tmp_path):
    broker = InProcessBroker({"dir": str(tmp_path)})

    def broken():
        raise RuntimeError("a bug in the writer")

    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            ctx = await nursery.start(broker.run)
            ctx.routelog.directory.new_file = broken
            async with SkanClient.connect(*broker.skan) as pub:
                await pub.send_raw(message(pub, "x", 1))
                await trio.sleep_forever()  # the broker's failure cancels this
    failure = info.value.subgroup(lambda e: isinstance(e, RuntimeError)
                                  and "routing log writer failed" in str(e))
    assert failure is not None


async def test_disk_errors_are_retried_without_loss(tmp_path):
    # JSON Lines: every hand-off reaches the file (Parquet writes per row group).
    b = BrokerProcess('[log]\nqueue_records = 100\nwhen_full = "backpressure"\nformat = "jsonl"\n',
                      workdir=tmp_path).start()
    pid = b.proc.pid
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    # A file may not grow past 4000 bytes: writes beyond fail with EFBIG
    # (Python ignores SIGXFSZ), as on a full disk.
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4000, hard))
    ledger = Ledger()
    try:
        async with SkanClient.connect(*b.skan) as pub:
            for i in range(60):
                await ledger.send(pub, message(pub, "disk", i))
            await pub.barrier()
            with trio.fail_after(10):
                while not any("cannot write" in line for line in b.stderr_lines):
                    await trio.sleep(0.05)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            for i in range(60, 100):
                await ledger.send(pub, message(pub, "disk", i))
            await pub.barrier()
    finally:
        assert b.stop() == 0
    records = read_log(tmp_path / "log")
    assert [r["seq"] for r in records] == [str(i) for i in range(100)]
    assert any("succeeded after" in line for line in b.stderr_lines)


def test_unusable_log_directory_refuses_start(tmp_path):
    (tmp_path / "file").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "broker", "--skan-port", "0", "--hsp-port", "0",
         "--eventer-port", "0", "--mariner-port", "0", "--metrics-port", "0",
         "--log-dir", str(tmp_path / "file" / "log")],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert "cannot start" in proc.stderr and "routing log directory" in proc.stderr


def test_second_broker_on_the_same_directory_is_refused(tmp_path):
    with (
        BrokerProcess("", workdir=tmp_path),
        pytest.raises(RuntimeError, match="in use by another broker"),
    ):
        BrokerProcess("", workdir=tmp_path).start()


def test_log_disabled_writes_nothing(tmp_path):
    with BrokerProcess("[log]\nenabled = false\n", workdir=tmp_path):
        pass
    assert not (tmp_path / "log").exists()


async def test_every_protocol_is_logged(tmp_path):
    from clients.hsp import SkanOverHSP
    from toolkit.eventer_client import EventerClient
    from toolkit.mariner_client import MarinerClient
    from wire.eventer import JsonPayload, RegisterEvent

    b = BrokerProcess("", workdir=tmp_path).start()
    try:
        async with (
            MarinerClient.connect(*b.addr["mariner"], client_id="m",
                                  subscriptions=[("plant", "*")]) as mariner,
            SkanClient.connect(*b.skan) as skan_sub,
            SkanOverHSP.connect(*b.addr["hsp"]) as hsp_pub,
            EventerClient.connect(*b.addr["eventer"], "log-test") as eventer_pub,
        ):
            await mariner.barrier()
            await skan_sub.subscribe("plant", "pump1")
            await eventer_pub.register([
                RegisterEvent(("plant", "pump1"), payload=JsonPayload({"n": i})) for i in range(3)
            ])
            for i in range(2):
                await hsp_pub.send("plant", str(i), instance="valve")
            await hsp_pub.barrier()
            got = 0
            while got < 5:
                got += len(await mariner.receive())
            eventer_lname = (await skan_sub.receive()).sender
    finally:
        assert b.stop() == 0
    records = read_log(tmp_path / "log")
    assert [(r["proto"], r["instance"], r["recipients"]) for r in records] == [
        ("eventer", "pump1", {"mariner": 1, "skan": 1})] * 3 + [
        ("hsp", "valve", {"mariner": 1})] * 2
    assert {r["lname"] for r in records[:3]} == {eventer_lname}
