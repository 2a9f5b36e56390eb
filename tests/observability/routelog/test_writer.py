"""The writer thread: both formats, rotation by size and age, when_full (back-pressure or
drop, counted), the lag of the oldest waiting record, stop flushes all."""

from __future__ import annotations

import io
import os
import threading
import time

import pyarrow.parquet as pq
import pytest

from broker.core.router import NORMAL, Router
from broker.observability.routelog import parquet
from broker.observability.routelog.columns import ColumnBuffer
from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.writer import RoutingLog
from tests.observability.routelog.logfiles import read_log
from tests.observability.routelog.test_record import records, send, sink


def published(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def read_all(path) -> list[dict]:
    return read_log(path)


def make_log(tmp_path, router=None, **kw) -> tuple[Router, RoutingLog]:
    router = router or Router(hostname="test")
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    opts = {"rotate_bytes": 1 << 30, "rotate_seconds": 3600.0, "queue_records": 1000,
            "when_full": "backpressure", **kw}
    rl = RoutingLog(d, **opts)
    rl.attach(router)
    return router, rl


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_stop_writes_every_record_in_order(tmp_path, fmt):
    router, rl = make_log(tmp_path, format=fmt)
    rl.start()
    pub, sub = sink(router), sink(router)
    router.subscribe(sub, b"g", b"*", NORMAL)
    for i in range(2500):
        send(router, pub, seq=str(i).encode())
    rl.stop()
    rl.join()
    recs = read_all(tmp_path)
    assert [r["seq"] for r in recs] == [str(i) for i in range(2500)]
    assert (rl.stats.records, rl.stats.files, rl.queued, rl.lag_seconds) == (2500, 1, 0, 0.0)
    assert published(tmp_path)[0].endswith("." + fmt)
    assert recs[0]["recipients"] == {"skan": 1} and recs[0]["delivered"] == 1


def test_parquet_columns_equal_the_json_lines(tmp_path):
    """Every column holds what the JSON line says, field for field (odd bytes included)."""
    router, rl = make_log(tmp_path)
    pub, a, b = sink(router), sink(router), sink(router, "eventer")
    router.subscribe(a, b"g", b"*", NORMAL)
    router.subscribe(b, b"g", b"*", NORMAL)
    routed = [send(router, pub, seq=b"7"), send(router, pub, group=b"none", seq=b""),
              send(router, pub, group="gr\u00fcn".encode(), instance=b"bin\xff", seq=b"a\"b")]
    rl.start()
    rl.stop()
    rl.join()
    assert read_all(tmp_path) == records(routed)
    table = pq.read_table(tmp_path / published(tmp_path)[0])
    assert table.schema.equals(parquet.SCHEMA)
    assert table.column("recipients").to_pylist()[0] == [("eventer", 1), ("skan", 1)]
    assert table.column("recipients").to_pylist()[1] == []


def test_row_groups_and_rotation_by_size_in_parquet(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet, "ROW_GROUP_ROWS", 100)
    router, rl = make_log(tmp_path, rotate_bytes=1, queue_records=40)  # 10 per hand-off
    rl.start()
    pub = sink(router)
    for i in range(1000):
        send(router, pub, seq=str(i).encode())
        if i % 10 == 9:
            wait_for(lambda: rl.queued == 0)
    rl.stop()
    rl.join()
    names = published(tmp_path)
    assert len(names) == rl.stats.files == 10  # a file per row group: each passes rotate_bytes
    assert all(pq.ParquetFile(tmp_path / n).metadata.num_rows == 100 for n in names)
    assert [r["seq"] for r in read_all(tmp_path)] == [str(i) for i in range(1000)]


def test_when_full_drop_counts_every_dropped_record_and_routing_goes_on(tmp_path):
    closes = []
    router, rl = make_log(tmp_path, queue_records=20, when_full="drop",
                          close_gate=lambda: closes.append(1))
    pub = sink(router)
    # The writer thread is not running yet: nothing drains, the backlog grows.
    for _ in range(100):
        send(router, pub)
    assert closes == [] and not rl.gate_closed and rl.stats.backpressure_closes == 0
    # Batches of 5 (queue_records // 4): accepted while at most 20 wait, then dropped.
    assert rl.stats.handed == 25 and rl.stats.dropped == 75 and rl.queued == 25
    rl.start()
    wait_for(lambda: rl.queued == 0)
    for _ in range(10):  # the writer caught up: nothing more is dropped
        send(router, pub)
    rl.stop()
    rl.join()
    assert len(read_all(tmp_path)) == 35 == rl.stats.records
    assert rl.stats.dropped == 75 and rl.stats.handed + rl.stats.dropped == 110


def test_rotation_by_size_in_json_lines(tmp_path):
    router, rl = make_log(tmp_path, rotate_bytes=4000, queue_records=40,  # 10 per hand-off
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
    assert len(names) == rl.stats.files > 5
    for name in names:
        assert (tmp_path / name).stat().st_size <= 4000
    assert [r["seq"] for r in read_all(tmp_path)] == [str(i) for i in range(300)]


def test_rotation_by_age_publishes_without_more_traffic(tmp_path):
    router, rl = make_log(tmp_path, rotate_seconds=0.2)
    rl.start()
    pub = sink(router)
    send(router, pub)
    rl.handoff()
    wait_for(lambda: rl.stats.files == 1)
    assert len(read_all(tmp_path)) == 1
    time.sleep(0.3)  # no traffic: no empty files
    assert rl.stats.files == 1
    send(router, pub)
    rl.handoff()
    wait_for(lambda: rl.stats.files == 2)
    rl.stop()
    rl.join()
    assert len(read_all(tmp_path)) == 2


def test_backlog_closes_the_gate_and_draining_reopens_it(tmp_path):
    events = []
    opened = threading.Event()

    def request_open():
        events.append("request-open")
        opened.set()

    router, rl = make_log(tmp_path, queue_records=20,
                          close_gate=lambda: events.append("close"), request_open=request_open)
    pub = sink(router)
    # The writer thread is not running yet: nothing drains, the backlog grows.
    for _ in range(30):
        send(router, pub)
    assert events == ["close"] and rl.gate_closed and rl.stats.backpressure_closes == 1
    for _ in range(100):  # routing still never blocks nor loses a record
        send(router, pub)
    assert events == ["close"] and rl.queued == 130
    assert not rl.reopen_if_drained()
    rl.start()
    assert opened.wait(10)
    wait_for(lambda: rl.queued == 0)
    assert rl.reopen_if_drained() and not rl.gate_closed
    rl.stop()
    rl.join()
    assert len(read_all(tmp_path)) == 130


def test_lag_is_the_age_of_the_oldest_waiting_record(tmp_path):
    router, rl = make_log(tmp_path, queue_records=4000)  # hand-offs of 1000
    pub = sink(router)
    send(router, pub)
    time.sleep(0.3)
    send(router, pub)
    assert rl.queued == 2 and 0.3 <= rl.lag_seconds < 1.0  # buffered, not yet handed off
    rl.handoff()
    time.sleep(0.2)
    # Handed off but not taken: still the first record's age, not since some idle moment.
    assert 0.5 <= rl.lag_seconds < 1.5
    rl.start()
    wait_for(lambda: rl.queued == 0)
    assert rl.lag_seconds == 0.0
    send(router, pub)  # a new record: its own age, not the time since the writer last caught up
    assert rl.lag_seconds < 0.1
    rl.stop()
    rl.join()
    assert rl.queued == 0 and rl.lag_seconds == 0.0


def test_parts_carry_across_hand_offs_and_epochs(tmp_path, monkeypatch):
    """A hand-off carries only the parts added since the previous one; once the table
    holds PARTS_CACHE parts a new epoch starts: every record still reads back right."""
    from broker.observability.routelog import columns

    monkeypatch.setattr(columns, "PARTS_CACHE", 4)
    router, rl = make_log(tmp_path, queue_records=20)  # hand-offs of 5
    pub, sub = sink(router), sink(router)
    routed = []
    for i in range(60):
        group = f"g{i % 7}".encode()
        if i % 11 == 0:
            router.subscribe(sub, group, b"*", NORMAL)  # new recipient tuples, new parts
        routed.append(send(router, pub, group=group, seq=str(i).encode()))
    assert rl.buffer._epoch > 2
    rl.start()
    rl.stop()
    rl.join()
    assert read_all(tmp_path) == records(routed)


def test_dropped_batches_still_give_the_writer_their_parts(tmp_path):
    """Records of a dropped batch are gone, but the parts it introduced reach the writer:
    later batches' keys name them (a broker once failed on exactly this)."""
    router, rl = make_log(tmp_path, queue_records=8, when_full="drop")  # hand-offs of 2
    pub = sink(router)
    routed = [send(router, pub, group=f"g{i}".encode(), seq=str(i).encode())
              for i in range(40)]  # each group new parts; most batches dropped
    later = [send(router, pub, group=f"g{i}".encode(), seq=str(100 + i).encode())
             for i in range(40)]  # the same parts again, from the cache
    assert rl.stats.dropped > 0
    rl.start()
    wait_for(lambda: rl.queued == 0)
    again = [send(router, pub, group=f"g{i}".encode(), seq=str(200 + i).encode())
             for i in range(0, 40, 5)]
    rl.stop()
    rl.join()
    got = read_all(tmp_path)
    assert rl.failure is None and len(got) == rl.stats.records == 80 + len(again) - rl.stats.dropped
    want = {r["seq"]: r for r in records(routed + later + again)}
    assert all(r == want[r["seq"]] for r in got)
    assert [r["seq"] for r in got[-len(again):]] == [str(200 + i) for i in range(0, 40, 5)]


def test_parquet_modules_load_before_the_broker_serves(tmp_path):
    """pyarrow (and pyarrow.compute, which Array.take would import on its first call)
    load when the Parquet log is made, before the broker serves: imported at the first
    hand-off instead, they held the interpreter in the writer thread while routing
    waited (a fresh broker's first 100 ms of traffic saw latencies up to 60 ms)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from broker.observability.routelog.files import LogDirectory
        from broker.observability.routelog.writer import RoutingLog
        d = LogDirectory({str(tmp_path)!r}, 1)
        d.open()
        before = "pyarrow.compute" in sys.modules
        rl = RoutingLog(d, rotate_bytes=1 << 30, rotate_seconds=3600.0, queue_records=1000,
                        when_full="backpressure", format="parquet")
        print(before, "pyarrow.compute" in sys.modules)
        rl.start()
        rl.stop()
        rl.join()
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_a_row_group_reaches_the_python_sink_in_one_write(monkeypatch):
    """Arrow's buffer in front of the Python sink: each write to it takes the GIL from
    the routing thread, so a row group goes over in one write, not one per page."""
    writes = []
    original = parquet._Sink.write

    def counted(self, b):
        writes.append(len(b))
        return original(self, b)

    monkeypatch.setattr(parquet._Sink, "write", counted)
    router = Router(hostname="test")
    buffer = parquet.PartsTable()
    cols = ColumnBuffer(1 << 20, lambda: None, router)
    router.observers.append(cols.observe)
    pub, sub = sink(router), sink(router)
    router.subscribe(sub, b"g", b"*", NORMAL)
    for i in range(20_000):
        send(router, pub, seq=str(i).encode())
    table = parquet.columns_to_table([cols.take()], buffer)
    encoder = parquet.ParquetEncoder()
    writes.clear()
    data = encoder.row_group([table])
    assert len(writes) == 1 and writes[0] == len(data) > 0
    tail = encoder.finish()
    assert pq.read_table(io.BytesIO(data + tail)).num_rows == 20_000


def test_a_row_group_is_converted_once_whatever_its_hand_offs(tmp_path, monkeypatch):
    """The writer keeps hand-offs as they come and makes one Arrow table a row group
    (the interpreter taken once, not once a hand-off); records stay in order."""
    monkeypatch.setattr(parquet, "ROW_GROUP_ROWS", 100)
    calls = []
    convert = parquet.columns_to_table
    monkeypatch.setattr(parquet, "columns_to_table",
                        lambda batches, table=None: calls.append(sum(b.rows for b in batches))
                        or convert(batches, table))
    router, rl = make_log(tmp_path, queue_records=40)  # 10 per hand-off
    rl.start()
    pub = sink(router)
    routed = []
    for i in range(250):
        routed.append(send(router, pub, group=f"g{i % 3}".encode(), seq=str(i).encode()))
        if i % 10 == 9:
            wait_for(lambda: rl.queued == 0)
    rl.stop()
    rl.join()
    assert calls == [100, 100, 50]  # two full row groups, the rest at stop
    assert read_all(tmp_path) == records(routed)


def test_a_table_of_batches_is_the_batches_one_after_the_other(tmp_path):
    """columns_to_table of several hand-offs: each batch's seqs and new parts in order;
    the table equals the per-batch tables concatenated."""
    router = Router(hostname="test")
    buf = ColumnBuffer(1_000_000, lambda: None, router)
    router.observers.append(buf.observe)
    pub, sub = sink(router), sink(router)
    batches = []
    for b in range(4):
        for i in range(7):
            if i == 3:
                router.subscribe(sub, f"g{b}".encode(), b"*", NORMAL)  # new parts mid-batch
            send(router, pub, group=f"g{b}".encode(), seq=f"{b}-{i}".encode() * i)
        batches.append(buf.take())
    batches.insert(2, parquet.Columns(0, bytearray(), bytearray(), bytearray(), bytearray(4),
                                      bytearray(), [], batches[0].epoch, 0.0))  # an empty one
    whole = parquet.columns_to_table(batches)
    one_by_one = parquet.PartsTable()
    expected = [parquet.columns_to_table([b], one_by_one) for b in batches]
    assert whole.num_rows == 28
    assert whole.to_pylist() == [r for t in expected for r in t.to_pylist()]
    with pytest.raises(ValueError):
        parquet.columns_to_table([batches[0], parquet.Columns(
            0, bytearray(), bytearray(), bytearray(), bytearray(4), bytearray(), [],
            batches[0].epoch + 1, 0.0)])


def test_a_row_group_of_long_seqs_is_converted_in_parts(tmp_path, monkeypatch):
    """Pending seq bytes stay under MAX_SEQ_BYTES (Arrow's int32 offsets): the writer
    converts what it holds before a batch would pass it."""
    from broker.observability.routelog import columns

    monkeypatch.setattr(columns, "MAX_SEQ_BYTES", 2000)
    calls = []
    convert = parquet.columns_to_table
    monkeypatch.setattr(parquet, "columns_to_table",
                        lambda batches, table=None: calls.append(
                            sum(len(b.seq_data) for b in batches)) or convert(batches, table))
    router, rl = make_log(tmp_path, queue_records=40)  # 10 per hand-off
    pub = sink(router)
    # Hand-offs of 600, 1200, 1200, 1200 and 1200 seq bytes.
    routed = [send(router, pub, seq=str(i).encode() * 60) for i in range(50)]
    rl.start()
    rl.stop()
    rl.join()
    assert calls == [1800, 1200, 1200, 1200]
    assert read_all(tmp_path) == records(routed)
