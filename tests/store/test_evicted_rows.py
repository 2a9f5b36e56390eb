"""Evicted rows wait for one DELETE of many: the bounds and what readers see stay exact.

Each message below is a run of its own (three types in turn), so every
commit past the count bound makes whole runs evicted rows.
"""

from __future__ import annotations

import sqlite3

from broker.store import writer
from tests.store.test_store import Clock, route, setup


def rows(store) -> int:
    return store._conn.execute("SELECT count(*) FROM runs").fetchone()[0]


def newest_ids(routed: list, n: int) -> list[tuple[int, int]]:
    return [(r.session, r.instance) for r in routed[-n:]]


def test_rows_wait_for_one_delete_while_count_and_readers_stay_exact(tmp_path):
    store, router, sender = setup(tmp_path, size=10)
    routed = route(router, sender, 10)
    store.flush()
    assert rows(store) == 10
    seen = set()
    for _ in range(3 * writer.DELETE_RUNS):
        routed += route(router, sender, 1)
        store.flush()
        # The bound and the readers are exact at every commit...
        assert store.count == 10
        assert [e[:2] for e in store.entries_after(0, 0)] == newest_ids(routed, 10)
        # ... while the evicted rows wait (never more than DELETE_RUNS of them).
        waiting = rows(store) - 10
        assert 0 <= waiting < writer.DELETE_RUNS
        seen.add(waiting)
    # They did wait, and they were deleted together.
    assert writer.DELETE_RUNS - 1 in seen and 0 in seen
    assert store.evicted == 3 * writer.DELETE_RUNS
    store.close()


def test_rows_that_waited_across_a_restart_are_found_and_deleted(tmp_path):
    clock = Clock()
    store, router, sender = setup(tmp_path, clock, size=10)
    routed = route(router, sender, 10 + writer.DELETE_RUNS // 2)
    store.flush()
    assert rows(store) == 10 + writer.DELETE_RUNS // 2  # half a chunk waits
    store.close()

    store, router, sender = setup(tmp_path, clock, size=10)
    assert store.count == 10
    assert [e[:2] for e in store.entries_after(0, 0)] == newest_ids(routed, 10)
    # The first eviction after the start walks the rows that waited (the
    # writer no longer knows them) and counts them towards the next DELETE.
    later = route(router, sender, writer.DELETE_RUNS // 2)
    store.flush()
    assert rows(store) == 10
    assert [e[:2] for e in store.entries_after(0, 0)] == newest_ids(routed + later, 10)
    store.close()


def test_byte_share_deletes_before_the_run_count(tmp_path):
    # max_bytes / DELETE_SHARE of evicted frames is all that may wait.
    store, router, sender = setup(tmp_path, size=1000, max_bytes=16 * 2000)
    assert store.delete_bytes == 2000
    most = 0
    for _ in range(100):
        route(router, sender, 1, size=400)  # frames of about 470 bytes
        store.flush()
        assert store._waiting[2] < store.delete_bytes
        most = max(most, rows(store) - store.count)
        assert store.bytes <= store.max_bytes
    assert 3 <= most <= 5 < writer.DELETE_RUNS
    store.close()


def test_everything_evicted_deletes_every_row_and_row_numbers_start_again(tmp_path):
    clock = Clock()
    store, router, sender = setup(tmp_path, clock, size=10, max_age=60.0)
    route(router, sender, 15)
    store.flush()
    assert rows(store) > 10  # five evicted rows wait
    clock.now += 61  # everything is older than max_age
    store._evict_only()
    assert store.count == 0 and rows(store) == 0
    # SQLite numbers rows from 1 again in an empty table: the scan must see them.
    fresh = route(router, sender, 25)
    store.flush()
    assert store._conn.execute("SELECT min(run) FROM runs").fetchone()[0] == 1
    assert store.count == 10
    assert [e[:2] for e in store.entries_after(0, 0)] == newest_ids(fresh, 10)
    store.close()


def test_a_failed_commit_leaves_the_waiting_rows_as_they_were(tmp_path):
    store, router, sender = setup(tmp_path, size=10)
    route(router, sender, 13)
    store.flush()
    before = store._waiting
    assert before[1] == 3

    def io_error(*args):  # fails after the eviction, inside the same transaction
        raise sqlite3.OperationalError("disk I/O error")

    store._write_meta = io_error
    route(router, sender, 5)
    store.flush()
    assert store.stats.failed_commits == 1
    assert store._waiting == before and store.count == 10 and rows(store) == 13
    del store._write_meta
    routed = route(router, sender, 12)
    store.flush()
    assert store.count == 10
    assert [e[:2] for e in store.entries_after(0, 0)] == newest_ids(routed, 10)
    store.close()
