"""The store's state file: what must outlive the loss of any one database file.

``store.state`` (JSON, beside ``store.sqlite3``) records the store's
identity, the session ceiling (every session the broker issued is below
it) and whether the broker stopped cleanly.  It is replaced atomically
(written to a temporary file, fsynced, renamed, directory fsynced), and
only at a few moments: when the broker starts (after the new ceiling is
committed, before anything routes), when the writer raises the ceiling
(rare: once per 5 * 10^8 sessions), and after a graceful stop's final
commit and checkpoint.

The database keeps the same facts in its ``meta`` table (``store_id``,
``session_ceiling``, ``clean``).  Opening cross-checks the two
(:func:`check`), so that losing the WAL, the main file or this file is
noticed rather than silently restarted (docs/store.md, "A store missing a
file").
"""

from __future__ import annotations

import json
import os
import secrets
import time

import attrs

STATE_NAME = "store.state"
FORMAT = "skan-broker store state"
VERSION = 1
# Bytes read at most from a state file (it is a few hundred): a huge file
# there is not ours.
MAX_STATE_BYTES = 64 * 1024


class StateError(Exception):
    """The state file cannot be read; the message says why."""


@attrs.define
class StoreState:
    store_id: str
    session_ceiling: int
    clean: bool


def new_store_id() -> str:
    return secrets.token_hex(16)


def state_path(directory: str) -> str:
    return os.path.join(directory, STATE_NAME)


def read_state(directory: str) -> StoreState | None:
    """The state file's content, None when there is none; raises StateError when unreadable."""
    path = state_path(directory)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read: {exc.strerror}") from None
    if len(raw) > MAX_STATE_BYTES:
        raise StateError(f"larger than {MAX_STATE_BYTES} bytes: not a state file")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StateError("not a broker store state file")
        if data.get("version") != VERSION:
            raise StateError(f"version {data.get('version')!r}; this broker reads version "
                             f"{VERSION} only")
        store_id, ceiling, clean = data["store_id"], data["session_ceiling"], data["clean"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StateError(f"damaged: {exc}") from None
    if (not isinstance(store_id, str) or type(ceiling) is not int or ceiling < 0
            or type(clean) is not bool):
        raise StateError("damaged: a field has the wrong type")
    return StoreState(store_id, ceiling, clean)


def write_state(directory: str, state: StoreState) -> None:
    """Replace the state file atomically and durably (raises OSError)."""
    path = state_path(directory)
    tmp = path + ".tmp"
    body = json.dumps({
        "format": FORMAT, "version": VERSION, "store_id": state.store_id,
        "session_ceiling": state.session_ceiling, "clean": state.clean,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
    }, indent=1).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def wal_present(db_path: str) -> bool:
    """Whether the WAL beside ``db_path`` exists.

    An empty one counts: a checkpoint with TRUNCATE (at a graceful stop, or
    when the writer keeps the WAL small) leaves it empty with everything in
    the main file.  Missing is what a lost WAL looks like (SQLite deletes it
    only when the last connection closes after a complete checkpoint).
    """
    return os.path.exists(db_path + "-wal")


@attrs.define
class DbFacts:
    """What the database (as SQLite reads it) says about itself."""

    store_id: str | None  # None: written before state files existed
    session_ceiling: int
    clean: bool | None  # None: not recorded (an older store)


def check(path: str, directory: str, db: DbFacts, state: StoreState | None,
          wal: bool) -> str | None:
    """Why this database cannot be opened with this state file and WAL (None: it can).

    ``wal``: the WAL exists (:func:`wal_present`).  A store written
    before state files existed (no ``store_id`` in the database) and
    without a state file passes: there is nothing to compare.
    """
    accept = f"skan-broker accept-store {directory}"
    if state is not None and db.store_id != state.store_id:
        return (f"belongs to another store than {STATE_NAME} beside it (database "
                f"{db.store_id or 'without an id'}, state file {state.store_id}): the "
                f"directory mixes two stores' files. Put back the matching {STATE_NAME} or "
                f"database; or, to adopt this database as it is, run '{accept}' (sessions "
                "continue above both)")
    behind = state is not None and db.session_ceiling < state.session_ceiling
    # Behind after a clean stop: an older copy put back (below), not a lost WAL.
    if not wal and (db.clean is False or (behind and state is not None and not state.clean)):
        return (f"its WAL {path}-wal is missing but the broker did not stop cleanly: the "
                "events committed since the last checkpoint were only in the WAL (starting "
                "without it would lose them and reissue EventIds). Restore "
                f"{os.path.basename(path)}-wal (and keep {STATE_NAME}); or, to keep only what "
                f"the main file holds and lose the rest, run '{accept}'. (If a tool such as "
                "the sqlite3 shell opened the store after the stop, it merged the WAL into "
                f"the main file and removed it: then nothing is lost, and '{accept}' is safe.)")
    if behind:
        assert state is not None
        return (f"lacks commits that {STATE_NAME} records (session ceiling "
                f"{db.session_ceiling} in the database, {state.session_ceiling} in the state "
                "file): its WAL was truncated, or this is an older copy of the database; the "
                "session counter would go backwards and reissue EventIds. Restore the newer "
                f"{os.path.basename(path)} and its -wal file; or, to keep what this database "
                f"holds and lose the rest, run '{accept}' (sessions continue above the state "
                "file's)")
    return None
