"""The store in-process, on real SQLite files: sessions, bounds, failed writes, reports."""

from __future__ import annotations

import logging

import pytest
import trio

from broker.core import events
from broker.core.router import Endpoint, Router
from broker.store import Store, StoreError
from broker.store.store import SESSION_LEASE


class Sender(Endpoint):
    protocol = "test"

    def deliver(self, frame, routed):  # pragma: no cover - never a recipient
        raise AssertionError


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def open_store(path, clock=None, **kw) -> Store:
    args = {"size": 1000, "max_bytes": 0, "max_age": 0.0, "flush_interval": 0.001}
    args.update(kw)
    return Store(str(path), clock=clock or Clock(), **args)


def route(router: Router, sender: Sender, n: int, group: str = "g", size: int = 10) -> list:
    out = []
    for i in range(n):
        sent = events.send_for_event((group, str(i % 3)), events.JsonPayload("x" * size),
                                     sender=sender.lname, seq=i)
        out.append(router.route(sender, sent.frame, sent.header))
        router.end_batch()
    return out


def setup(path, clock=None, **kw):
    clock = clock or Clock()
    router = Router(clock=clock)
    store = open_store(path, clock, **kw)
    store.attach(router)
    sender = Sender()
    router.attach(sender)
    return store, router, sender


def test_sessions_continue_above_everything_issued_even_with_the_clock_stepped_back(tmp_path):
    store, router, sender = setup(tmp_path)
    routed = route(router, sender, 5)
    store.flush()
    # More batches routed but never committed (as if the process were killed now).
    unflushed = route(router, sender, 5)
    newest = max((r.session, r.instance) for r in routed + unflushed)
    # A second broker on the same directory, its clock stepped back by a day.
    back = Clock(1_700_000_000.0 - 86_400)
    router2 = Router(clock=back)
    store2 = open_store(tmp_path, back)
    store2.attach(router2)
    sender2 = Sender()
    router2.attach(sender2)
    again = route(router2, sender2, 1)[0]
    assert (again.session, again.instance) > newest
    assert again.session - newest[0] <= 2 * SESSION_LEASE
    store2.close()
    store.close()


def test_bounds_by_count_bytes_and_age_evict_oldest_first_and_count(tmp_path):
    clock = Clock()
    store, router, sender = setup(tmp_path, clock, size=10, max_bytes=0)
    routed = route(router, sender, 25)
    assert len(store.entries_after(0, 0)) == 10
    assert store.evicted == 15 and store.evicted_upto == (routed[14].session, 1)
    store.close()

    store, router, sender = setup(tmp_path / "bytes", clock, size=1000, max_bytes=1000)
    routed = route(router, sender, 20, size=100)
    kept = store.entries_after(0, 0)
    assert sum(len(e[3]) for e in kept) <= 1000 < sum(len(e[3]) for e in kept) + len(
        routed[0].frame)
    assert [e[0] for e in kept] == [r.session for r in routed[-len(kept):]]
    assert store.bytes == sum(len(e[3]) for e in kept)
    store.close()

    store, router, sender = setup(tmp_path / "age", clock, max_age=60.0)
    route(router, sender, 3)
    clock.now += 30
    young = route(router, sender, 2)
    store.flush()
    clock.now += 45  # the first three are now 75 s old, the last two 45 s
    route(router, sender, 1)
    kept = store.entries_after(0, 0)
    assert [e[0] for e in kept][:2] == [r.session for r in young]
    assert len(kept) == 3 and store.evicted == 3
    store.close()


async def test_max_age_applies_while_idle(tmp_path):
    clock = Clock()
    store, router, sender = setup(tmp_path, clock, max_age=10.0)
    store.start(trio.lowlevel.current_trio_token().run_sync_soon)
    route(router, sender, 4)
    store.flush()
    clock.now += 11
    with trio.fail_after(5):
        while store.count:
            await trio.sleep(0.05)
    assert store.evicted == 4
    store.close()


async def test_commits_are_reported_in_order_from_the_writer_thread(tmp_path):
    store, router, sender = setup(tmp_path)
    reports = []
    store.on_report.append(lambda upto, ok: reports.append((upto, ok)))
    store.start(trio.lowlevel.current_trio_token().run_sync_soon)
    routed = route(router, sender, 50)
    last = (routed[-1].session, routed[-1].instance)
    with trio.fail_after(5):
        while not reports or reports[-1][0] != last:
            await trio.sleep(0.01)
    assert all(ok for _, ok in reports)
    assert [u for u, _ in reports] == sorted(u for u, _ in reports)
    assert store.stats.commits >= 1 and store.stats.events_written == 50
    store.close()


async def test_commits_nobody_awaits_do_not_wake_the_routing_thread(tmp_path):
    store, router, sender = setup(tmp_path)
    reports, wanted = [], [False]
    store.on_report.append(lambda upto, ok: reports.append((upto, ok)))
    store.reports_wanted = lambda: wanted[0]
    woken = []

    def call_soon(fn):
        woken.append(fn)
        trio_token.run_sync_soon(fn)

    trio_token = trio.lowlevel.current_trio_token()
    store.start(call_soon)
    route(router, sender, 20)
    router.hand_over()
    with trio.fail_after(5):
        while store.stats.events_written < 20:
            await trio.sleep(0.01)
    await trio.sleep(0.05)
    assert woken == [] and reports == [] and not store._reports  # dropped, not kept
    # Awaited again: the next commit reports everything up to its last message.
    wanted[0] = True
    routed = route(router, sender, 5)
    last = (routed[-1].session, routed[-1].instance)
    with trio.fail_after(5):
        while not reports or reports[-1][0] != last:
            await trio.sleep(0.01)
    assert woken and all(ok for _, ok in reports)
    store.close()


def test_a_full_disk_is_counted_logged_once_and_routing_goes_on(tmp_path, caplog):
    store, router, sender = setup(tmp_path)
    reports = []
    store.on_report.append(lambda upto, ok: reports.append((upto, ok)))
    route(router, sender, 2)
    store.flush()
    # SQLite's own limit on the database size: every further page allocation
    # fails with SQLITE_FULL ("database or disk is full"), as on a full disk.
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")
    caplog.set_level(logging.WARNING, logger="broker.store.writer")
    failed = []
    for _ in range(5):
        failed += route(router, sender, 1, size=20_000)
        store.flush()
    assert all(r.delivered == 0 for r in failed)  # routed all the same
    assert store.stats.failed_commits == 5 and store.stats.failed_events == 5
    assert [ok for _, ok in reports[-5:]] == [False] * 5
    lines = [r for r in caplog.records if "write failed" in r.getMessage()]
    assert len(lines) == 1 and "full" in lines[0].getMessage()
    # Space again: persisting resumes.
    store._conn.execute("PRAGMA max_page_count = 1073741823")
    ok = route(router, sender, 1)
    store.flush()
    assert reports[-1] == ((ok[0].session, ok[0].instance), True)
    assert store.count == 3
    # ... and says so, once.
    recovered = [r.getMessage() for r in caplog.records if "writing again" in r.getMessage()]
    assert recovered == [f"store {store.path}: writing again after 5 failed commits (5 "
                         "messages not persisted so far)"]
    route(router, sender, 1)
    store.flush()
    assert len([r for r in caplog.records if "writing again" in r.getMessage()]) == 1
    store.close()


def test_spool_and_resume_points_survive_reopening(tmp_path):
    store, router, sender = setup(tmp_path)
    routed = route(router, sender, 4)
    for r in routed:
        store.spool_add("hsp-0-x:1", r)
    store.spool_remove("hsp-0-x:1", routed[1].session, routed[1].instance)
    store.set_resume("mariner-1-y:2", 7, 8, 9)
    store.close()
    store = open_store(tmp_path)
    assert [(r.session, r.frame) for r in store.spooled("hsp-0-x:1")] == [
        (r.session, r.frame) for r in (routed[0], routed[2], routed[3])]
    assert store.spooled("other") == []
    assert store.resume_point("mariner-1-y:2") == (7, 8, 9)
    store.close()


def test_schema_version_mismatch_is_refused(tmp_path):
    store = open_store(tmp_path)
    store._conn.execute("UPDATE meta SET value = 99 WHERE key = 'schema_version'")
    store.close()
    with pytest.raises(StoreError, match="schema version 99"):
        open_store(tmp_path)


def test_isolated_messages_of_one_type_share_a_row_and_keep_their_event_ids(tmp_path):
    """One message per routing batch (one session each): one run, every EventId exact."""
    import sqlite3

    clock = Clock()
    store, router, sender = setup(tmp_path, clock, size=25)
    routed = []
    for i in range(40):
        clock.now += 0.001
        sent = events.send_for_event(("g", "t"), events.JsonPayload(f"m{i}"),
                                     sender=sender.lname, seq=i)
        routed.append(router.route(sender, sent.frame, sent.header))
        router.end_batch()
        if i == 19:
            store.flush()  # two commits: two rows
    store.flush()
    ids = [(r.session, r.instance) for r in routed]
    assert len({s for s, _ in ids}) == 40  # 40 sessions
    conn = sqlite3.connect(tmp_path / "store.sqlite3")
    rows = conn.execute("SELECT count(*), count(ids) FROM runs").fetchone()
    conn.close()
    # Two commits, two rows; 15 of the older row's 20 events evicted (size 25).
    assert rows == (2, 2)
    kept = ids[-25:]
    assert [(e[0], e[1]) for e in store.entries_after(0, 0)] == kept
    assert [(e[0], e[1]) for e in store.entries_after(*kept[9])] == kept[10:]
    assert store.entry(*kept[7])[0][3] == routed[15 + 7].frame
    assert store.entry(*ids[3]) is None  # evicted
    assert store.evicted_upto == ids[14]
    # Later in the same run: the latest table names the newest EventId.
    newest = store.newest()
    assert (newest.session, newest.instance) == ids[-1]
    store.close()


def test_a_version_1_store_is_upgraded_in_place_and_its_runs_still_read(tmp_path):
    """Before runs could span sessions (schema 1): no ids column; opened, it gains one."""
    import sqlite3

    store, router, sender = setup(tmp_path)
    routed = route(router, sender, 6)
    store.close()
    conn = sqlite3.connect(tmp_path / "store.sqlite3")
    assert conn.execute("SELECT count(ids) FROM runs").fetchone() == (0,)
    conn.execute("ALTER TABLE runs DROP COLUMN ids")
    conn.execute("UPDATE meta SET value = 1 WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    store, router, sender = setup(tmp_path)
    more = route(router, sender, 6)
    store.flush()
    assert [(e[0], e[1]) for e in store.entries_after(0, 0)] == [
        (r.session, r.instance) for r in routed + more]
    store.close()
    conn = sqlite3.connect(tmp_path / "store.sqlite3")
    assert dict(conn.execute("SELECT key, value FROM meta"))["schema_version"] == 2
    conn.close()


@pytest.mark.parametrize("case", ["one-type", "two-types", "clock-back", "single"])
def test_a_batch_of_one_type_is_one_row_built_in_c_level_calls(case):
    """batch_row() makes a batch of one type one row that decodes to every message,
    and declines (None) a batch that is not one run."""
    from broker.store.batch_rows import batch_row, decode

    clock = Clock()
    router = Router(clock=clock)
    sender = Sender()
    router.attach(sender)
    batch = []
    for i in range(1 if case == "single" else 50):
        group = "h" if case == "two-types" and i >= 30 else "g"
        clock.now += -0.5 if case == "clock-back" and i == 20 else 0.001
        sent = events.send_for_event((group, "1"), events.JsonPayload("x" * i),
                                     sender=sender.lname, seq=i)
        batch.append(router.route(sender, sent.frame, sent.header))
    row = batch_row(batch)
    if case in ("one-type", "single"):
        # decode() reads the columns a query selects: the row's, src_us and ids.
        columns = (*row[:5], *row[9:13], row[7], None)
        assert [(e[0], e[1], e[2], e[3], e[4], e[5], e[6]) for e, _ in decode(columns)] == [
            (r.session, r.instance, r.timestamp, r.frame, r.delivered, r.header[b"group"],
             r.header[b"instance"]) for r in batch]
    else:
        assert row is None


def test_the_bridge_spool_keeps_its_newest_messages_within_spool_max_bytes(tmp_path):
    from broker.store.spool import BridgeSpool

    store, router, sender = setup(tmp_path, spool_max_bytes=1000)
    routed = route(router, sender, 30, size=100)

    def newest_within(msgs: list, bound: int) -> list:
        kept: list = []
        for r in reversed(msgs):
            if sum(len(k.frame) for k in kept) + len(r.frame) > bound:
                break
            kept.insert(0, r)
        return kept

    spool = BridgeSpool.of(store, "hsp-0-x:1")
    assert spool.restore() == []
    pushed = []
    for r in routed[:20]:
        pushed += spool.added(r)
    kept = newest_within(routed[:20], 1000)
    assert 1 < len(kept) < 20
    # Oldest first, and each one only once.
    assert pushed == [(r.session, r.instance) for r in routed[:20 - len(kept)]]
    assert store.stats.spool_dropped == 20 - len(kept)
    # An acknowledgement of a message already pushed out changes nothing.
    spool.removed(routed[0])
    spool.removed(routed[19])
    kept.pop()
    assert spool.nbytes == sum(len(r.frame) for r in kept)
    store.close()

    # Reopened with a lower bound: the oldest beyond it are dropped at restore.
    bound = sum(len(r.frame) for r in kept[-2:])
    store = open_store(tmp_path, spool_max_bytes=bound)
    restored = BridgeSpool.of(store, "hsp-0-x:1").restore()
    assert [r.frame for r in restored] == [r.frame for r in kept[-2:]]
    assert store.stats.spool_dropped == len(kept) - 2
    store.close()
    store = open_store(tmp_path)
    assert [r.frame for r in store.spooled("hsp-0-x:1")] == [r.frame for r in kept[-2:]]
    store.close()


def test_a_message_above_spool_max_bytes_alone_is_kept(tmp_path):
    from broker.store.spool import BridgeSpool

    store, router, sender = setup(tmp_path, spool_max_bytes=50)
    small, big = route(router, sender, 1, size=1)[0], route(router, sender, 1, size=500)[0]
    spool = BridgeSpool.of(store, "eventer-0-x:1")
    assert spool.added(small) == []
    assert spool.added(big) == [(small.session, small.instance)]
    store.close()
    store = open_store(tmp_path, spool_max_bytes=50)
    assert [r.frame for r in BridgeSpool.of(store, "eventer-0-x:1").restore()] == [big.frame]
    store.close()


def _fill_disk(store: Store) -> None:
    """SQLite's own limit on the database size: every further page allocation
    fails with SQLITE_FULL ("database or disk is full"), as on a full disk."""
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")


def _free_disk(store: Store) -> None:
    store._conn.execute("PRAGMA max_page_count = 1073741823")


async def test_spool_operations_of_a_failed_commit_are_retried_by_the_next(tmp_path):
    store, router, sender = setup(tmp_path)
    first = route(router, sender, 2)
    for r in first:
        store.spool_add("hsp-0-x:1", r)
    store.flush()
    _fill_disk(store)
    big = route(router, sender, 3, size=20_000)  # retained events: not persisted
    for r in big:
        store.spool_add("hsp-0-x:1", r)
    store.spool_remove("hsp-0-x:1", first[0].session, first[0].instance)
    store.spool_remove("hsp-0-x:1", big[0].session, big[0].instance)  # never reached the disk
    store.set_resume("mariner-1-y:2", 1, 2, 3)
    store.flush()
    assert store.stats.failed_commits == 1 and store.stats.failed_events == 3
    # Kept: two inserts (the third cancelled by its delete), one delete, one resume point.
    assert store.pending() == 4 and store.stats.spool_retried == 0
    _free_disk(store)
    # No new traffic: the writer's idle wake-up commits what was kept.
    store.start(trio.lowlevel.current_trio_token().run_sync_soon)
    with trio.fail_after(5):
        while store.stats.spool_retried < 4:
            await trio.sleep(0.05)
    assert store.pending() == 0 and store.stats.spool_lost == 0
    store.close()
    store = open_store(tmp_path)
    assert [r.frame for r in store.spooled("hsp-0-x:1")] == [
        r.frame for r in (first[1], big[1], big[2])]
    assert store.resume_point("mariner-1-y:2") == (1, 2, 3)
    # The retained events of the failed batch stay unpersisted.
    assert [e[3] for e in store.entries_after(0, 0)] == [r.frame for r in first]
    store.close()


def test_spool_operations_kept_across_failed_commits_are_bounded_and_counted(tmp_path):
    from broker.store.carry import SpoolCarry

    store, router, sender = setup(tmp_path)
    _fill_disk(store)
    msgs = route(router, sender, 6, size=20_000)
    store._carry = SpoolCarry(max_bytes=sum(len(r.frame) for r in msgs[3:]), max_deletes=2)
    for r in msgs:
        store.spool_add("hsp-0-x:1", r)
    for i in range(5):
        store.spool_remove("eventer-0-x:2", 10, i)  # rows that may be on disk
    store.flush()
    assert store.stats.spool_lost == 3 + 3
    assert [a[4] for a in store._carry.adds] == [r.frame for r in msgs[3:]]
    assert [d[2] for d in store._carry.deletes] == [3, 4]
    _free_disk(store)
    store.close()  # the last try at close commits what was kept
    store = open_store(tmp_path)
    assert [r.frame for r in store.spooled("hsp-0-x:1")] == [r.frame for r in msgs[3:]]
    store.close()


def test_group_indexes_written_without_the_instance_are_rebuilt_at_open(tmp_path):
    import sqlite3

    from broker.store.retained_query import run_store_query
    from wire import eventer as w

    store, router, sender = setup(tmp_path)
    routed = route(router, sender, 9)
    store.close()
    with sqlite3.connect(tmp_path / "store.sqlite3") as conn:  # as version 1 first shipped
        conn.execute("DROP INDEX runs_grp_min")
        conn.execute("DROP INDEX runs_grp_max")
        conn.execute("CREATE INDEX runs_grp_min ON runs (grp, min_ts, session, first)")
        conn.execute("CREATE INDEX runs_grp_max ON runs (grp, max_ts, session, last)")
    conn.close()
    store = open_store(tmp_path)
    for name in ("runs_grp_min", "runs_grp_max"):
        assert [r[2] for r in store._conn.execute(f"PRAGMA index_info({name})")][-1] == "inst"
    # One type of the group's three: named in the walk of the group index.
    assert store._wanted_types(b"g", lambda g, i: i == b"1") == [b"1"]
    assert store._wanted_types(b"g", lambda g, i: True) is None
    answer = run_store_query(w.QueryTimeseriesParams((("g", "1"),)), store, 1)
    assert [e[:2] for e in answer.entries] == [
        (r.session, r.instance) for r in reversed(routed[1::3])]
    store.close()


def test_max_age_evicts_part_of_a_run_then_the_rest(tmp_path):
    clock = Clock()
    store, router, sender = setup(tmp_path, clock, max_age=60.0)
    routed = []
    for i in range(10):  # one routing batch, one type: one run of ten
        clock.now += 0.05
        sent = events.send_for_event(("g", "1"), events.JsonPayload("x"), sender=sender.lname,
                                     seq=i)
        routed.append(router.route(sender, sent.frame, sent.header))
    router.end_batch()
    store.flush()
    assert store._conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    clock.now = routed[4].timestamp + 60.01  # the first five are older than 60 s
    store._evict_only()
    assert store.evicted == 5 and store.evicted_upto == (routed[4].session, routed[4].instance)
    assert [e[1] for e in store.entries_after(0, 0)] == [r.instance for r in routed[5:]]
    assert store.bytes == sum(len(r.frame) for r in routed[5:])
    clock.now = routed[8].timestamp + 60.01
    store._evict_only()
    assert store.evicted == 9 and store.count == 1
    clock.now += 1
    store._evict_only()
    assert store.count == 0 and store.bytes == 0
    assert store._conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    store.close()


def test_bytes_bound_evicts_part_of_a_run_at_each_commit(tmp_path):
    store, router, sender = setup(tmp_path, size=1000, max_bytes=2000)
    routed = []
    for _ in range(6):  # runs of 7 messages; the bound cuts inside them
        for i in range(7):
            sent = events.send_for_event(("g", "1"), events.JsonPayload("x" * 90),
                                         sender=sender.lname, seq=i)
            routed.append(router.route(sender, sent.frame, sent.header))
        router.end_batch()
        store.flush()
        kept = store.entries_after(0, 0)
        sizes = [len(r.frame) for r in routed]
        n = len(kept)
        assert sum(sizes[-n:]) <= 2000 < sum(sizes[-n - 1:]) or n == len(routed)
        assert [e[3] for e in kept] == [r.frame for r in routed[-n:]]
        assert store.bytes == sum(sizes[-n:]) and store.evicted == len(routed) - n
    store.close()


def test_a_read_waits_for_the_commit_the_writer_thread_is_making(tmp_path, monkeypatch):
    """A query right after routing must see the message even when the writer thread
    has just taken it from the queue and is still committing it (issue 24: a latest
    query answered empty now and then)."""
    import threading
    import time

    from broker.store import writer as store_module

    store, router, sender = setup(tmp_path)
    route(router, sender, 1)
    router.hand_over()
    taken = threading.Event()
    expand = store_module._expand

    def slow_expand(ops):
        if threading.current_thread().name == "writer":
            taken.set()
            time.sleep(0.3)  # the commit in progress, its operations off the queue
        return expand(ops)

    monkeypatch.setattr(store_module, "_expand", slow_expand)

    def writer() -> None:
        with store._lock:
            store._commit_queued()

    thread = threading.Thread(target=writer, name="writer")
    thread.start()
    assert taken.wait(5)
    assert not store._ops  # the queue is empty: only the lock tells a commit is under way
    assert len(store.latest_entries(None)) == 1
    thread.join()
    store.close()


def test_taking_the_queue_keeps_order_the_limit_and_the_byte_budget(tmp_path):
    """_take's whole-queue path (everything queued fits the transaction's bytes)
    and its per-operation path (it does not) take the same operations in order."""
    store, router, sender = setup(tmp_path)
    try:
        route(router, sender, 10, size=100)
        queued = list(store._ops)
        assert len(queued) == 10
        # Fits the budget: the first `limit` operations, the rest left queued.
        assert store._take(4) == queued[:4]
        assert list(store._ops) == queued[4:]
        # Over the budget: one operation at least, then no more than the bytes allow.
        store.txn_bytes = 1
        assert store._take(10) == queued[4:5]
        store.txn_bytes = 10 ** 9
        assert store._take(0) == []
        assert store._take(100) == queued[5:]
        assert not store._ops
        # Runs as the process writer's child queues them (RUN operations, taken
        # open runs) count against the budget too.
        from broker.store.writer import _expand

        route(router, sender, 3, size=100)  # three types: three runs
        runs = list(_expand(list(store._ops)))
        store._ops.clear()
        store._ops.extend(runs)
        store.txn_bytes = runs[0][1][8]
        assert store._take(3) == runs[:1]
    finally:
        store.close()


def test_the_eviction_read_ahead_forgets_the_rows_of_a_failed_commit(tmp_path, monkeypatch):
    """The eviction scan reads runs ahead of need (SCAN_PAGE), inside the commit's
    transaction, so it may read the rows that commit inserts: when the commit
    fails they are gone, and SQLite numbers the next commit's row the same.
    Eviction must count the rows committed, not the ones rolled back."""
    import sqlite3

    store, router, sender = setup(tmp_path, size=4)
    for _ in range(6):  # at the bound: every commit evicts a run
        route(router, sender, 1, size=10)
        store.flush()
    real = store._write_meta

    def fail_once(*args):  # after the scan, before COMMIT
        monkeypatch.setattr(store, "_write_meta", real)
        raise sqlite3.OperationalError("injected")

    monkeypatch.setattr(store, "_write_meta", fail_once)
    store._scan_ahead.clear()  # this commit's scan reads a page: its own new row too
    route(router, sender, 1, size=10)
    store.flush()
    assert store.stats.failed_commits == 1
    for k in range(8):  # the same row numbers again, other sizes
        route(router, sender, 1, size=300 + k)
        store.flush()
    kept = store.entries_after(0, 0)
    assert store.count == len(kept) == 4
    assert store.bytes == sum(len(e[3]) for e in kept)
    store.close()
