"""The store's writer in a child process ([store] writer = "process"): the same store,
its reports and counters across the pipe, a child that dies, a broker that dies."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest
import trio

from broker.core.router import Router
from broker.store import Store, writer_process
from broker.store.writer_process import ProcessStore
from tests.brokerproc import BrokerProcess
from tests.store.test_store import Clock, Sender, route


def setup(path, **kw):
    clock = Clock()
    router = Router(clock=clock)
    args = {"size": 1000, "max_bytes": 0, "max_age": 0.0, "flush_interval": 0.001}
    args.update(kw)
    store = ProcessStore(str(path), clock=clock, **args)
    store.attach(router)
    sender = Sender()
    router.attach(sender)
    return store, router, sender


async def test_the_writer_process_commits_reports_and_the_broker_reads(tmp_path):
    store, router, sender = setup(tmp_path)
    reports = []
    store.on_report.append(lambda upto, ok: reports.append((upto, ok)))
    store.start(trio.lowlevel.current_trio_token().run_sync_soon)
    child = store._proc.pid
    assert child != os.getpid()
    routed = route(router, sender, 50)
    store.spool_add("hsp-0-x", routed[3])
    store.set_resume("mariner-1-y", 7, 11, 12)
    last = (routed[-1].session, routed[-1].instance)
    with trio.fail_after(10):
        while not reports or reports[-1][0] != last:
            await trio.sleep(0.01)
    assert all(ok for _, ok in reports)
    assert [u for u, _ in reports] == sorted(u for u, _ in reports)
    # Counters come back from the child; queries read the same WAL database here.
    assert store.stats.commits >= 1 and store.stats.events_written == 50
    assert store.count == len(store) == 50
    assert (store.newest().session, store.newest().instance) == last
    assert [r.instance for r in store.spooled("hsp-0-x")] == [routed[3].instance]
    store.close()
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # ended and reaped
    # The thread writer opens what the process wrote; sessions continue above.
    again = Store(str(tmp_path), size=1000, max_bytes=0, max_age=0.0, flush_interval=0.001)
    assert again.count == 50
    assert again.resume_point("mariner-1-y") == (7, 11, 12)
    router2 = Router()
    again.attach(router2)
    assert router2.session > routed[-1].session
    again.close()


def test_a_writer_process_that_dies_is_counted_and_replaced(tmp_path, monkeypatch):
    store, router, sender = setup(tmp_path)
    reports = []
    store.on_report.append(lambda upto, ok: reports.append((upto, ok)))
    first = route(router, sender, 3)
    store.flush()  # starts the child on first use
    assert reports[-1] == ((first[-1].session, first[-1].instance), True)
    os.kill(store._proc.pid, signal.SIGKILL)
    lost = route(router, sender, 2)
    store.spool_add("hsp-0-x", lost[0])
    store.flush()
    # Its hand-over: not persisted (counted, reported), the spool insert kept.
    assert store.stats.writer_deaths == 1
    assert reports[-1] == ((lost[-1].session, lost[-1].instance), False)
    assert store.stats.failed_commits >= 1 and store.stats.failed_events >= 2
    assert store.pending() == 1
    # Within RESPAWN_INTERVAL no new child: the next hand-over fails the same way.
    more = route(router, sender, 1)
    store.flush()
    assert reports[-1] == ((more[0].session, more[0].instance), False)
    assert store._proc is None
    # Then a new one, which commits the kept spool insert with the new messages.
    monkeypatch.setattr(writer_process, "RESPAWN_INTERVAL", 0.0)
    ok = route(router, sender, 1)
    store.flush()
    assert reports[-1] == ((ok[0].session, ok[0].instance), True)
    assert store.pending() == 0
    # Counters never go back across children: the dead child's commits stay counted.
    assert store.stats.commits >= 2 and store.stats.events_written == 4
    assert store.stats.failed_commits == 2 and store.stats.failed_events == 3
    assert [r.instance for r in store.spooled("hsp-0-x")] == [lost[0].instance]
    assert store.count == 4  # the 3 first and the last: the lost ones are not there
    store.close()


def _children(pid: int) -> list[int]:
    kids = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").exists(), reason="Linux /proc")
def test_the_writer_process_dies_with_the_broker_and_runs_at_writer_nice(tmp_path):
    proc = BrokerProcess("[broker]\nwriter_nice = 3\n", ("--store-writer", "process"),
                         workdir=tmp_path).start()
    try:
        kids = _children(proc.proc.pid)
        assert len(kids) == 1
        child = kids[0]
        cmdline = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        assert b"broker.store.writer_process" in cmdline
        assert os.getpriority(os.PRIO_PROCESS, child) == \
            os.getpriority(os.PRIO_PROCESS, proc.proc.pid) + 3
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        proc.stop()


def test_a_batch_of_several_types_crosses_the_pipe_message_by_message(tmp_path):
    from broker.core import events

    store, router, sender = setup(tmp_path)
    sent = []
    for i in range(6):  # one routing batch, two groups taking turns
        msg = events.send_for_event((f"g{i % 2}", "a"), events.JsonPayload(i),
                                    sender=sender.lname, seq=i)
        sent.append(router.route(sender, msg.frame, msg.header))
    router.end_batch()
    store.flush()
    assert store.count == 6 and store.stats.events_written == 6
    got = [(e[0], e[1], e[3]) for e, _ in store.ordered(
        by_source=False, descending=False, groups=None, t_from=None, t_to=None, s_from=None,
        s_to=None, after=None)]
    assert sorted(got) == sorted((r.session, r.instance, r.frame) for r in sent)
    store.close()
