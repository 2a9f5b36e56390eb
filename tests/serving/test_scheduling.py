"""Scheduler hints (broker/serving/scheduling.py): in a thread, and in a running broker."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import platform
import struct
import sys
import threading
import time

import pytest

from broker.serving import scheduling
from broker.serving.config import WRITER_DEFAULT
from tests.brokerproc import BrokerProcess

linux = pytest.mark.skipif(sys.platform != "linux", reason="per-thread hints are Linux's")


def _in_thread(fn):  # type: ignore[no-untyped-def]
    """fn() in a fresh thread (hints stick to a thread); returns its result."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _slice_ns() -> int:
    """The calling thread's slice as sched_getattr reports it."""
    return _slice_of(threading.get_native_id())


def _raw_set_slice(ns: int) -> int:
    """sched_setattr called directly (0 or the errno): is the call allowed here?"""
    libc = ctypes.CDLL(None, use_errno=True)
    set_nr = {"x86_64": 314, "aarch64": 274}[platform.machine()]
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, 0, 0, ns, 0, 0), 48)
    return 0 if libc.syscall(set_nr, threading.get_native_id(), attr, 0) == 0 \
        else ctypes.get_errno()


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _custom_slices() -> bool:
    """Whether this machine takes a custom slice: x86_64 or aarch64, Linux 6.12
    or later, and sched_setattr allowed (no seccomp profile refusing it)."""
    return (platform.machine() in ("x86_64", "aarch64") and _kernel() >= (6, 12)
            and not _in_thread(lambda: _raw_set_slice(300_000)))


@linux
def test_slice_is_set_on_the_calling_thread_only() -> None:
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("system call numbers known for x86_64 and aarch64")
    refused = _in_thread(lambda: _raw_set_slice(300_000))
    if refused:  # e.g. a seccomp profile without sched_setattr
        assert _in_thread(lambda: scheduling.set_thread_slice(200e-6)) is False
        pytest.skip(f"sched_setattr refused here: {os.strerror(refused)}")
    before = _slice_ns()

    def set_and_read() -> tuple[bool, int, int]:
        ok = scheduling.set_thread_slice(200e-6)
        return ok, _slice_ns(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ok, inside, nice = _in_thread(set_and_read)
    assert ok
    if _kernel() >= (6, 12):
        assert inside == 200_000
    assert nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # nice kept
    assert _slice_ns() == before  # the test's own thread is untouched


@linux
def test_slice_is_clamped_to_what_the_kernel_takes() -> None:
    if not _custom_slices():
        pytest.skip("custom slices need Linux 6.12 on x86_64 or aarch64, and sched_setattr")
    assert _in_thread(lambda: (scheduling.set_thread_slice(1e-9), _slice_ns())[1]) == 100_000
    assert _in_thread(lambda: (scheduling.set_thread_slice(5.0), _slice_ns())[1]) == 100_000_000


@linux
def test_lower_priority_raises_nice_of_the_calling_thread_only() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def lower() -> tuple[bool, int]:
        ok = scheduling.lower_thread_priority(7)
        return ok, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ok, nice = _in_thread(lower)
    assert ok and nice == min(19, mine + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert _in_thread(lambda: scheduling.lower_thread_priority(0)) is False


def _thread_nices(pid: int) -> list[int]:
    """The nice value of each thread of ``pid`` (field 19 of /proc stat)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        out.append(int(stat[stat.rindex(")") + 2:].split()[16]))
    return out


def _slice_of(tid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    get_nr = {"x86_64": 315, "aarch64": 275}[platform.machine()]
    buf = ctypes.create_string_buffer(48)
    assert libc.syscall(get_nr, tid, buf, 48, 0) == 0
    return struct.unpack("IIQiIQQQ", buf.raw)[5]


@linux
@pytest.mark.parametrize(("config", "store_nice", "log_nice", "slice_ns"), [
    ("", 10, 0, 100_000),
    ("[broker]\nwriter_nice = 3\nrouting_slice = 0.0005\n[log]\nwriter_nice = 5\n",
     3, 5, 500_000),
    ("[broker]\nwriter_nice = 0\nrouting_slice = 0\n", 0, 0, None),
])
def test_broker_threads_get_the_configured_hints(config: str, store_nice: int, log_nice: int,
                                                 slice_ns: int | None) -> None:
    """The store's writer thread and process run at [broker] writer_nice, the routing log's at
    [log] writer_nice, the routing thread with the configured slice; every other
    thread as the process."""
    with BrokerProcess(config) as proc:
        assert proc.proc is not None
        pid = proc.proc.pid
        base = os.getpriority(os.PRIO_PROCESS, pid)
        lowered = sorted(min(19, base + n) for n in (store_nice, log_nice) if n)
        deadline = time.monotonic() + 10
        while True:  # the writers lower themselves when they start
            nices = _thread_nices(pid)
            if sorted(n for n in nices if n != base) == lowered or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sorted(n for n in nices if n != base) == lowered, nices
        assert nices.count(base) == len(nices) - len(lowered), nices
        # The store's SQLite work runs in its writer process ([store] writer =
        # "process", the default): at [broker] writer_nice as well, all its threads.
        kids = [int(k) for t in pathlib.Path(f"/proc/{pid}/task").iterdir()
                for k in (t / "children").read_text().split()]
        if (os.environ.get("SKAN_TEST_STORE_WRITER") or WRITER_DEFAULT) == "process":
            assert len(kids) == 1
            assert set(_thread_nices(kids[0])) == {min(19, base + store_nice)}
        else:
            assert kids == []
        if _custom_slices():
            if slice_ns is None:
                assert _slice_of(pid) == _in_thread(_slice_ns)  # the kernel's default
            else:
                assert _slice_of(pid) == slice_ns


def test_a_reload_says_the_hints_need_a_restart() -> None:
    """The threads apply the hints as they start: a SIGHUP cannot change them."""
    import attrs

    from broker.app.reload import _restart_needed
    from broker.serving.config import Config

    old = Config()
    new = attrs.evolve(old, broker=attrs.evolve(old.broker, routing_slice=0.001, writer_nice=3))
    assert _restart_needed(old, new) == ["broker.routing_slice", "broker.writer_nice"]
    assert _restart_needed(old, attrs.evolve(old, broker=attrs.evolve(
        old.broker, writer_idle=False))) == ["broker.writer_idle"]
    assert _restart_needed(old, old) == []


def _policy(tid: int, pid: str = "self") -> int:
    """A thread's scheduling policy (field 41 of /proc stat)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[38])


class _Writer:
    """A live thread that ran ``background.setup`` and waits: a writer stand-in."""

    def __init__(self, background: scheduling.Background) -> None:
        self.done = threading.Event()
        ready = threading.Event()
        self.tid = 0

        def run() -> None:
            self.tid = threading.get_native_id()
            background.setup()
            ready.set()
            self.done.wait()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        ready.wait()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


needs_the_right = pytest.mark.skipif(
    sys.platform != "linux" or not scheduling.may_raise_priority(10),
    reason="raising a thread back from SCHED_IDLE needs root, CAP_SYS_NICE or RLIMIT_NICE")


@needs_the_right
def test_a_background_writer_is_idle_until_behind_and_idle_again_once_caught_up() -> None:
    bg = scheduling.Background(10, idle=True)
    writer = _Writer(bg)
    try:
        assert bg.idle and _policy(writer.tid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, writer.tid) >= 10  # its nice value too
        bg.behind()  # from this (another) thread, as the routing thread does
        assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, writer.tid) >= 10  # nice kept
        bg.behind()  # nothing to change: no system call
        bg.caught_up()
        assert bg.idle and _policy(writer.tid) == os.SCHED_IDLE
        assert bg.switches == 3
    finally:
        writer.stop()
    assert _policy(threading.get_native_id()) == os.SCHED_OTHER  # the caller untouched


@needs_the_right
def test_after_routing_ran_late_a_writer_keeps_its_nice_value_for_a_while() -> None:
    """An idle writer starved while it holds the GIL stalls routing: once routing ran
    late, the writer keeps its nice value for HOLD_NICE, doubled while stalls
    come back within a hold's length of the last one's end."""
    hold = scheduling.HOLD_NICE
    bg = scheduling.Background(10, idle=True)
    writer = _Writer(bg)
    try:
        now = time.monotonic()
        assert bg.stalled(now) == hold
        assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
        bg.caught_up()  # held: no going idle
        assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
        assert bg.stalled(now + 1) == 0  # already held: the same hold
        # The next stall soon after the hold ended: twice as long.
        assert bg.stalled(now + hold + 1) == 2 * hold
        assert bg.stalled(now + 3 * hold + 2) == 4 * hold
        # One long after: back to the first length (the machine was quiet).
        quiet = now + 7 * hold + 2 + 8 * hold + 1
        assert bg.stalled(quiet) == hold
        # A hold that ended (stalled long ago): caught_up goes idle again.
        late = scheduling.Background(10, idle=True)
        other = _Writer(late)
        try:
            assert late.stalled(time.monotonic() - 2 * hold) == hold
            assert not late.idle
            late.caught_up()
            assert late.idle and _policy(other.tid) == os.SCHED_IDLE
        finally:
            other.stop()
    finally:
        writer.stop()


@needs_the_right
def test_one_stall_watch_holds_every_writer_and_says_so_once(caplog) -> None:
    """The broker's one watch: a stall holds every writer that may go idle, in one log
    line naming them; a writer that may not go idle is not watched; the checks run
    at the watch's pace; with nothing to watch, run() returns at once."""
    import trio

    watch = scheduling.StallWatch()
    trio.run(watch.run)  # nothing to watch: returns
    store = scheduling.Background(10, idle=True, name="store writer")
    log = scheduling.Background(10, idle=True, name="routing-log writer")
    never = scheduling.Background(10, idle=False, name="never idle")
    checked: list[int] = []
    watch.add(store, lambda: checked.append(1))
    watch.add(log)
    watch.add(never, lambda: checked.append(2))
    assert watch.backgrounds == [store, log] and len(watch.checks) == 1
    writers = [_Writer(b) for b in (store, log, never)]
    try:
        assert store.idle and log.idle and not never.idle
        with caplog.at_level("INFO", logger="broker.serving.scheduling"):
            watch.stalled(0.3)
            watch.stalled(0.3)  # within the hold: no second line
        assert not store.idle and not log.idle
        assert [_policy(w.tid) for w in writers] == [os.SCHED_OTHER] * 3
        lines = [r.getMessage() for r in caplog.records if "routing ran" in r.getMessage()]
        assert lines == [
            "routing ran 300 ms late, as the CPUs are busy: writers kept at their nice value "
            f"(not SCHED_IDLE) for {scheduling.HOLD_NICE:.0f} s: store writer, routing-log writer"]

        async def two_intervals() -> None:
            # Until the check has run twice (a slow machine makes intervals late).
            with trio.fail_after(20 * scheduling.WATCH_INTERVAL), trio.CancelScope() as scope:
                watch.checks.append(lambda: len(checked) >= 2 and scope.cancel())
                await watch.run()

        started = time.monotonic()
        trio.run(two_intervals)
        assert checked == [1, 1]
        assert time.monotonic() - started >= 2 * scheduling.WATCH_INTERVAL
    finally:
        for w in writers:
            w.stop()


@linux
def test_without_idle_or_the_right_a_writer_keeps_its_nice_value(monkeypatch) -> None:
    for bg in (scheduling.Background(5, idle=False), None):
        if bg is None:  # the right to come back is missing: never idle
            monkeypatch.setattr(scheduling, "may_raise_priority", lambda nice: False)
            bg = scheduling.Background(5, idle=True)
        writer = _Writer(bg)
        try:
            bg.caught_up()
            assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
            assert bg.switches == 0
        finally:
            writer.stop()


@needs_the_right
def test_the_routing_log_raises_a_starved_writer_when_its_backlog_grows(tmp_path) -> None:
    """handoff() on the routing thread: past a quarter of queue_records waiting, an idle
    writer gets its nice value back (a writer starved of CPU cannot notice it itself)."""
    from broker.core.router import Router
    from broker.observability.routelog.files import LogDirectory
    from broker.observability.routelog.writer import RoutingLog
    from tests.observability.routelog.test_record import send, sink

    d = LogDirectory(str(tmp_path), 1)
    d.open()
    rl = RoutingLog(d, rotate_bytes=1 << 30, rotate_seconds=3600.0, queue_records=400)
    router = Router(hostname="test")
    rl.attach(router)
    rl.background = bg = scheduling.Background(0, idle=True)
    writer = _Writer(bg)  # stands in for the writer thread, which never takes anything here
    try:
        pub = sink(router)
        for i in range(100):  # hand-offs of 100: the backlog reaches 100, not past it
            send(router, pub, seq=str(i).encode())
        assert bg.idle
        for i in range(101):
            send(router, pub, seq=str(i).encode())
        rl.handoff()
        assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
    finally:
        writer.stop()
        d.close()


@linux
@pytest.mark.parametrize("idle", [True, False])
def test_the_broker_writer_threads_are_idle_where_they_may_be(idle: bool) -> None:
    config = "" if idle else "[broker]\nwriter_idle = false\n"
    if (os.environ.get("SKAN_TEST_STORE_WRITER") or WRITER_DEFAULT) == "process":
        pytest.skip("the store's writer is a process here")
    expect = 2 if idle and scheduling.may_raise_priority(10) else 0
    with BrokerProcess(config) as proc:
        assert proc.proc is not None
        pid = proc.proc.pid

        def idle_threads() -> int:
            n = 0
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                n += int(stat[stat.rindex(")") + 2:].split()[38]) == os.SCHED_IDLE
            return n

        # A stall while the broker starts holds the writers HOLD_NICE (10 s).
        deadline = time.monotonic() + 2 * scheduling.HOLD_NICE + 5
        while idle_threads() != expect and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle_threads() == expect  # the store's and the routing log's writers


@needs_the_right
def test_a_broker_whose_routing_stalled_keeps_its_writers_at_their_nice_value() -> None:
    """The whole broker stopped (SIGSTOP) for longer than STALL: on waking, its
    routing thread finds its watch timer late and both writers leave SCHED_IDLE
    for a hold, which the log says once."""
    if (os.environ.get("SKAN_TEST_STORE_WRITER") or WRITER_DEFAULT) == "process":
        pytest.skip("the store's writer is a process here")
    import signal

    with BrokerProcess() as proc:
        assert proc.proc is not None
        pid = proc.proc.pid

        def idle_threads() -> int:
            n = 0
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError):  # a thread that ended
                    n += _policy(int(tid), str(pid)) == os.SCHED_IDLE
            return n

        # A stall while the broker starts holds the writers HOLD_NICE (10 s).
        deadline = time.monotonic() + 2 * scheduling.HOLD_NICE + 5
        while idle_threads() != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle_threads() == 2
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4 * scheduling.STALL + scheduling.WATCH_INTERVAL)
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while idle_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle_threads() == 0
        time.sleep(1.0)  # within the hold: they stay at their nice value
        assert idle_threads() == 0
        proc.stop()
    held = [line for line in proc.stderr_lines if "writers kept at their nice value" in line]
    assert len(held) == 1, proc.stderr_lines[-20:]  # one watch, one line a stall
    assert held[0].rstrip().endswith(": routing-log writer, store writer"), held[0]


@needs_the_right
def test_the_store_raises_a_writer_that_commits_nothing_while_messages_wait(tmp_path) -> None:
    """check_progress (the trio thread's watch, scheduling.WATCH_INTERVAL): a writer
    under SCHED_IDLE that committed nothing between two checks while operations
    waited is starved; it gets its nice value back.  The byte bound (observe) raises
    it too, far sooner under a flood."""
    from broker.store import writer as store_writer
    from tests.store.test_store import route, setup

    store, router, sender = setup(tmp_path)  # the writer thread is never started: starved
    store.background = bg = scheduling.Background(10, idle=True)
    writer = _Writer(bg)
    try:
        store.check_progress()  # nothing queued
        store.check_progress()
        assert bg.idle
        route(router, sender, 3)
        store.check_progress()  # messages came since the last look: not late yet
        assert bg.idle
        store.check_progress()  # no commit since, the messages still waiting
        assert not bg.idle and _policy(writer.tid) == os.SCHED_OTHER
        bg.caught_up()
        route(router, sender, 1, size=store_writer.BEHIND_BYTES)  # past the byte bound
        route(router, sender, 1)  # observe sees the backlog
        assert not bg.idle
    finally:
        writer.stop()
        store.close()
