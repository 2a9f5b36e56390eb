"""A store missing a file is refused, never silently truncated or restarted (BROKER-SPEC 10).

Real broker processes: an Eventer client registers events while another
asks for persisted notifications; the broker is killed (SIGKILL) in the
middle of that traffic; then a file of the store goes missing the way an
operator's disk or hand would lose it.  The broker must refuse to start,
naming the path and what to do; once the file is back, every event it
notified as persisted is there and no EventId repeats.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import trio

from tests.brokerproc import ROOT, BrokerProcess
from tests.store.test_restart import stopped, workdir
from toolkit.eventer_client import EventerClient
from wire.eventer.messages import QueryTimeseriesParams, RegisterEvent
from wire.hat import EventId, JsonPayload

pytestmark = [pytest.mark.trio]

DB = "store.sqlite3"
TYPE = ("mf", "*")

Id = tuple[int, int, int]


def key(event_id: EventId) -> Id:
    return (event_id.server, event_id.session, event_id.instance)


async def traffic_then_kill(proc: BrokerProcess, *, minimum: int = 2000) -> tuple[set[Id], Id]:
    """Register events in batches until ``minimum`` were notified persisted, then SIGKILL
    the broker while registrations go on.  Returns the ids notified persisted and the
    largest id the broker gave out."""
    port = proc.addr["eventer"][1]
    persisted: set[Id] = set()
    issued: list[Id] = []
    async with EventerClient.connect(port=port, subscriptions=[TYPE], persisted=True) as watcher, \
            EventerClient.connect(port=port) as reg:

        async def watch() -> None:
            with contextlib.suppress(Exception):
                async for events in watcher:
                    persisted.update(key(e.id) for e in events)

        async def register() -> None:
            with contextlib.suppress(Exception):
                i = 0
                while True:
                    events = await reg.register(
                        [RegisterEvent(("mf", str(j % 5)), payload=JsonPayload({"n": i + j}))
                         for j in range(50)])
                    issued.extend(key(e.id) for e in events or ())
                    i += 50

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(register)
            with trio.fail_after(60):
                while len(persisted) < minimum:
                    await trio.sleep(0.05)
            # Killed with registrations and commits in flight.
            stopped(proc, signal.SIGKILL)
            nursery.cancel_scope.cancel()
    return persisted, max([*issued, *persisted])


async def all_events(proc: BrokerProcess) -> list[Id]:
    """Every stored event of TYPE, paged (a page holds at most 10,000)."""
    found: list[Id] = []
    last = None
    async with EventerClient.connect(port=proc.addr["eventer"][1]) as hat:
        while True:
            result = await hat.query(QueryTimeseriesParams(event_types=(TYPE,),
                                                           last_event_id=last))
            found += [key(e.id) for e in result.events]
            if not result.more_follows:
                return found
            last = result.events[-1].id


async def new_event(proc: BrokerProcess) -> Id:
    async with EventerClient.connect(port=proc.addr["eventer"][1]) as hat:
        [event] = await hat.register([RegisterEvent(("other", "x"))])
    return key(event.id)


def refused(wd: pathlib.Path, *needles: str) -> str:
    """Start a broker on ``wd``: it must exit 1 with one line naming ``needles``."""
    proc = BrokerProcess(workdir=wd)
    with pytest.raises(RuntimeError) as info:
        proc.start()
    assert proc.proc is not None and proc.proc.wait(5) == 1
    message = "".join(proc.stderr_lines)
    assert "Traceback" not in message, message
    lines = [line for line in proc.stderr_lines if "skan-broker: cannot start" in line]
    assert len(lines) == 1, message
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert str(info.value)
    return lines[0]


def files(store: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in store.iterdir()}


def state(store: pathlib.Path) -> dict:
    return json.loads((store / "store.state").read_text())


async def check_restart(wd: pathlib.Path, persisted: set[Id], issued_max: Id) -> BrokerProcess:
    """A broker on ``wd`` keeps every persisted event; new EventIds are above all before."""
    proc = BrokerProcess(workdir=wd).start()
    stored = await all_events(proc)
    assert len(stored) == len(set(stored)), "an EventId repeats in the store"
    missing = persisted - set(stored)
    assert not missing, f"{len(missing)} events notified as persisted are gone"
    assert await new_event(proc) > max(issued_max, *stored)
    return proc


async def earlier_run(wd: pathlib.Path) -> None:
    """A first run stopped gracefully: the main file holds a store (checkpointed)."""
    proc = BrokerProcess(workdir=wd).start()
    await new_event(proc)
    stopped(proc, signal.SIGTERM)


@pytest.mark.parametrize("lost", ["wal", "wal-of-a-new-store", "main"])
async def test_a_store_missing_a_file_is_refused_until_it_is_restored(lost):
    wd = workdir()
    store = wd / "store"
    if lost != "wal-of-a-new-store":
        await earlier_run(wd)
    proc = BrokerProcess(workdir=wd).start()
    persisted, issued_max = await traffic_then_kill(proc)
    aside = wd / "aside"
    aside.mkdir()
    name = DB if lost == "main" else f"{DB}-wal"
    assert (store / f"{DB}-wal").stat().st_size > 0
    shutil.move(store / name, aside / name)
    before = files(store)
    if lost == "wal":
        refused(wd, f"store {store / DB}", "-wal is missing", "did not stop cleanly",
                f"Restore {DB}-wal", f"skan-broker accept-store {store}")
    elif lost == "wal-of-a-new-store":
        refused(wd, f"store {store / DB}", "-wal is missing", "holds no store without it",
                f"Restore {DB}-wal", "to start a new empty store")
    else:
        refused(wd, f"store {store / DB}", "missing, but", f"Restore {DB}",
                "to start a new empty store")
    # A refused store is left exactly as it was.
    assert files(store) == before
    shutil.move(aside / name, store / name)
    proc = await check_restart(wd, persisted, issued_max)
    stopped(proc, signal.SIGTERM)
    assert state(store)["clean"] is True


@pytest.mark.parametrize("lost", ["shm", "state"])
async def test_files_the_broker_can_do_without_are_rebuilt(lost):
    """The -shm file (SQLite rebuilds it from the WAL) and the state file (rebuilt from
    a database whose WAL is there) are not needed to keep what was persisted."""
    wd = workdir()
    store = wd / "store"
    proc = BrokerProcess(workdir=wd).start()
    persisted, issued_max = await traffic_then_kill(proc)
    (store / (f"{DB}-shm" if lost == "shm" else "store.state")).unlink()
    proc = await check_restart(wd, persisted, issued_max)
    if lost == "state":
        assert any("store.state is missing; recreated" in line for line in proc.stderr_lines)
        assert state(store)["clean"] is False  # running
    stopped(proc, signal.SIGTERM)


async def test_a_lost_wal_accepted_by_the_operator_never_reissues_an_eventid():
    wd = workdir()
    store = wd / "store"
    await earlier_run(wd)
    proc = BrokerProcess(workdir=wd).start()
    _, issued_max = await traffic_then_kill(proc)
    (store / f"{DB}-wal").unlink()
    refused(wd, "-wal is missing")
    done = subprocess.run([sys.executable, "-m", "broker", "accept-store", str(store)],
                          capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "accepted as it is" in done.stdout
    proc = BrokerProcess(workdir=wd).start()
    try:
        stored = await all_events(proc)
        # What only the WAL held is gone (the operator said so); what is left
        # repeats nothing, and the numbering continues above the killed broker's.
        assert len(stored) == len(set(stored))
        assert await new_event(proc) > issued_max
    finally:
        stopped(proc, signal.SIGTERM)


async def test_without_its_database_files_a_store_starts_anew_above_the_old_sessions():
    wd = workdir()
    store = wd / "store"
    proc = BrokerProcess(workdir=wd).start()
    _, issued_max = await traffic_then_kill(proc, minimum=200)
    for name in (DB, f"{DB}-wal", f"{DB}-shm"):
        (store / name).unlink()
    proc = BrokerProcess(workdir=wd).start()
    try:
        assert any("started a new, empty store" in line for line in proc.stderr_lines)
        assert await all_events(proc) == []
        assert await new_event(proc) > issued_max
    finally:
        stopped(proc, signal.SIGTERM)


async def test_an_older_copy_of_the_database_is_refused():
    """The session counter would go backwards: refused; accept-store takes it knowingly."""
    wd = workdir()
    store = wd / "store"
    proc = BrokerProcess(workdir=wd).start()
    first = await new_event(proc)
    stopped(proc, signal.SIGTERM)
    old = (store / DB).read_bytes()
    proc = BrokerProcess(workdir=wd).start()
    second = await new_event(proc)
    stopped(proc, signal.SIGTERM)
    (store / DB).write_bytes(old)
    refused(wd, "lacks commits that store.state records", "older copy",
            "session counter would go backwards")
    done = subprocess.run([sys.executable, "-m", "broker", "accept-store", str(store)],
                          capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert done.returncode == 0, done.stderr
    proc = BrokerProcess(workdir=wd).start()
    try:
        assert await new_event(proc) > second > first
    finally:
        stopped(proc, signal.SIGTERM)
