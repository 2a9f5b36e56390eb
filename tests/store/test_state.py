"""The state file and the open-time cross-check, in process (broker/store/state.py, db.py).

The real-process scenarios (SIGKILL, then a file lost) are in
tests/store/test_missing_files.py; these cover the combinations that are
awkward to produce with a real crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3

import pytest

from broker.store.db import DB_NAME, SESSION_LEASE, StoreError, accept_store, open_store
from broker.store.state import STATE_NAME, StoreState, read_state, write_state
from broker.store.store import Store


def new_store(path) -> Store:
    store = Store(str(path), size=1000, max_bytes=0, max_age=0, flush_interval=0.001)
    store.start_session(1)
    return store


def meta(path) -> dict:
    """The main file's meta (immutable: a normal connection's close would merge and delete
    the WAL, as the sqlite3 shell does)."""
    uri = f"file:{path / DB_NAME}?immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return dict(conn.execute("SELECT key, value FROM meta"))


def test_the_state_file_follows_the_store_life_cycle(tmp_path):
    store = new_store(tmp_path)
    running = read_state(str(tmp_path))
    assert running == StoreState(store.store_id, 1 + SESSION_LEASE, False)
    store.close()
    assert read_state(str(tmp_path)) == StoreState(store.store_id, 1 + SESSION_LEASE, True)
    assert meta(tmp_path)["clean"] == 1 and meta(tmp_path)["store_id"] == store.store_id
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_NAME, STATE_NAME]


def test_a_raised_ceiling_reaches_the_state_file(tmp_path):
    store = new_store(tmp_path)
    store._max_session = store._ceiling  # as if the router had used half the lease and more
    store._ceiling = store._max_session + 1  # the next commit raises it
    store.set_resume("b", 1, 2, 3)
    store.flush()
    assert read_state(str(tmp_path)).session_ceiling == store._ceiling
    store.close()


def test_stopped_between_the_checkpoint_and_the_state_file_opens(tmp_path):
    """Killed after the final checkpoint (WAL gone) but before the state file said clean."""
    store = new_store(tmp_path)
    state = read_state(str(tmp_path))
    store.close()
    write_state(str(tmp_path), state)  # clean: false, as before the close's last step
    conn, found = open_store(str(tmp_path))
    conn.close()
    assert found == state


def test_a_state_file_of_another_store_is_refused(tmp_path):
    new_store(tmp_path).close()
    state = read_state(str(tmp_path))
    write_state(str(tmp_path), StoreState("someone-else", state.session_ceiling, True))
    with pytest.raises(StoreError, match="belongs to another store"):
        open_store(str(tmp_path))
    assert "accepted as it is" in accept_store(str(tmp_path))
    assert read_state(str(tmp_path)).store_id == meta(tmp_path)["store_id"]
    open_store(str(tmp_path))[0].close()


@pytest.mark.parametrize("content", [b"", b"{", b'{"format": "x"}', json.dumps(
    {"format": "skan-broker store state", "version": 1, "store_id": "a",
     "session_ceiling": -1, "clean": True}).encode()])
def test_a_damaged_state_file_is_refused_with_its_path(tmp_path, content):
    new_store(tmp_path).close()
    (tmp_path / STATE_NAME).write_bytes(content)
    with pytest.raises(StoreError) as info:
        open_store(str(tmp_path))
    assert str(tmp_path / STATE_NAME) in str(info.value)


def test_a_store_from_before_state_files_gets_an_id(tmp_path, caplog):
    new_store(tmp_path).close()
    (tmp_path / STATE_NAME).unlink()
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("DELETE FROM meta WHERE key IN ('store_id', 'clean')")
        conn.commit()
    caplog.set_level(logging.WARNING)
    store = new_store(tmp_path)
    assert not [r for r in caplog.records if "missing" in r.getMessage()]
    store.close()
    assert read_state(str(tmp_path)).store_id == store.store_id == meta(tmp_path)["store_id"]


def test_a_lost_state_file_is_recreated_when_the_database_stopped_cleanly(tmp_path, caplog):
    store = new_store(tmp_path)
    store.close()
    (tmp_path / STATE_NAME).unlink()
    caplog.set_level(logging.WARNING)
    again = new_store(tmp_path)
    assert any("store.state is missing; recreated" in r.getMessage() for r in caplog.records)
    assert again.store_id == store.store_id
    assert read_state(str(tmp_path)).session_ceiling > 1 + SESSION_LEASE
    again.close()


def test_accept_store_sessions_continue_above_every_ceiling_known(tmp_path):
    store = new_store(tmp_path)
    store.close()
    old_ceiling = read_state(str(tmp_path)).session_ceiling
    write_state(str(tmp_path), StoreState(store.store_id, old_ceiling * 5, False))
    with pytest.raises(StoreError, match="missing but the broker did not stop cleanly"):
        open_store(str(tmp_path))
    accept_store(str(tmp_path))
    again = new_store(tmp_path)
    assert again.start_session(0) >= old_ceiling * 5 + SESSION_LEASE
    again.close()


def test_accept_store_without_a_database_says_what_to_do(tmp_path):
    with pytest.raises(StoreError, match="no database to accept"):
        accept_store(str(tmp_path))


def test_killed_after_a_truncating_checkpoint_opens(tmp_path):
    """An empty WAL is not a lost one: a TRUNCATE checkpoint put everything in the main file."""
    running = tmp_path / "running"
    store = new_store(running)
    store.set_resume("b", 1, 2, 3)
    store.flush()
    store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert (running / f"{DB_NAME}-wal").stat().st_size == 0
    # The files as a SIGKILL would leave them now (the connection still open).
    killed = tmp_path / "killed"
    shutil.copytree(running, killed)
    store.close()
    assert meta(killed)["clean"] == 0 and read_state(str(killed)).clean is False
    again = new_store(killed)
    assert again.resume_point("b") == (1, 2, 3)
    again.close()
