"""Scheduler hints: the routing thread runs first, the disk writers give way.

On a machine with few cores the durable store's and the routing log's writer
threads share the CPUs with the routing thread (and with the clients).  When
a message arrives while a writer is in the middle of a commit, Linux's
scheduler (EEVDF, kernel 6.6 and later) lets the writer finish its slice
before the woken routing thread runs, and that wait lands in the latency's
tail.  Measured on the two-core benchmark machine (docs/performance.md,
"Scheduler hints"): a background thread doing 4 % of a core in 400 us bursts
raised the routing p99 about as much as the whole store did.

Two hints, both per thread and both the kernel's own means:

- the routing thread asks for a short slice (``sched_setattr`` with
  ``sched_runtime``, honoured for normal threads since Linux 6.12): its
  virtual deadline comes sooner, so it preempts a writer when it wakes;
- the writer threads lower their priority (``setpriority``, a nice value):
  under contention they get a smaller share; idle cores still run them at
  full speed.  RocksDB lowers its compaction threads the same way.

Neither changes what is written or when it is acknowledged.  Both fail
quietly (logged at debug) where the kernel or the platform lacks them.

A third, where the broker may use it (:class:`Background`): a writer that
keeps up runs under ``SCHED_IDLE``, which the kernel preempts at once for
any normal thread that wakes (EEVDF lets a nice-10 writer finish its slice,
up to a 4 ms tick here, first); one that falls behind goes back to its nice
value, so a flood that fills the cores cannot starve it.  Going back needs
the right to raise a thread's priority (root, ``CAP_SYS_NICE``, or an
``RLIMIT_NICE`` that covers the nice value); without it the writer keeps
its nice value and never goes idle.  RocksDB's ``CpuPriority::kIdle`` puts
its background threads under ``SCHED_IDLE`` the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import resource
import struct
import sys
import threading
import time
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

# sched_setattr / sched_getattr system call numbers (not in the os module).
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr, first version (48 bytes): size, policy, flags, nice,
# priority, runtime, deadline, period.
_SCHED_ATTR = struct.Struct("IIQiIQQQ")

# The kernel clamps a custom slice to [0.1 ms, 100 ms].
MIN_SLICE = 100e-6
MAX_SLICE = 0.1


def _sched_attr_calls() -> tuple[object, int, int] | None:
    if sys.platform != "linux":
        return None
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to load
        return None
    return libc, numbers[0], numbers[1]


def set_thread_slice(seconds: float) -> bool:
    """Ask the scheduler for a ``seconds`` slice for the calling thread.

    Keeps the thread's policy and nice value.  True when the kernel took it;
    a kernel before 6.12 takes the call and ignores the slice.
    """
    calls = _sched_attr_calls()
    if calls is None:
        log.debug("scheduler slice: not supported on %s/%s", sys.platform, platform.machine())
        return False
    libc, set_nr, get_nr = calls
    tid = threading.get_native_id()
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if libc.syscall(get_nr, tid, buf, _SCHED_ATTR.size, 0) != 0:  # type: ignore[attr-defined]
        log.debug("scheduler slice: sched_getattr failed: %s", os.strerror(ctypes.get_errno()))
        return False
    _size, policy, flags, nice, priority, _runtime, deadline, period = _SCHED_ATTR.unpack(buf.raw)
    if policy != os.SCHED_OTHER:
        return False  # a real-time or idle policy set by the operator stays as it is
    runtime = int(min(max(seconds, MIN_SLICE), MAX_SLICE) * 1e9)
    attr = ctypes.create_string_buffer(
        _SCHED_ATTR.pack(_SCHED_ATTR.size, policy, flags, nice, priority, runtime, deadline,
                         period), _SCHED_ATTR.size)
    if libc.syscall(set_nr, tid, attr, 0) != 0:  # type: ignore[attr-defined]
        log.debug("scheduler slice: sched_setattr failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def lower_thread_priority(increment: int) -> bool:
    """Raise the calling thread's nice value by ``increment`` (Linux: nice is per thread)."""
    if increment <= 0 or sys.platform != "linux":
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except OSError as exc:
        log.debug("thread priority: %s", exc)
        return False
    return True


# CAP_SYS_NICE's bit in /proc/self/status's CapEff (linux/capability.h).
_CAP_SYS_NICE = 23


def may_raise_priority(nice: int) -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to SCHED_OTHER at
    ``nice`` (the kernel's can_nice: CAP_SYS_NICE, or RLIMIT_NICE >= 20 - nice)."""
    if sys.platform != "linux":
        return False
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    if int(line.split()[1], 16) >> _CAP_SYS_NICE & 1:
                        return True
                    break
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (OSError, ValueError, AttributeError):
        return False
    return soft == resource.RLIM_INFINITY or soft >= 20 - nice


# A writer under SCHED_IDLE runs only on a CPU nothing else wants.  On a
# machine whose CPUs are all busy it may wait hundreds of milliseconds for
# one, and when it holds the GIL meanwhile, routing waits with it (priority
# inversion).  bench.gil_waits, whose probes load both cores of the
# benchmark machine, saw routing wait 0.15-1.3 s for an idle writer, and
# 12-18 ms with the writers at their nice value.  So a routing thread that
# ran late (its watch timer fired more than STALL late) keeps the writers
# at their nice value for HOLD_NICE seconds, doubled for each stall that
# comes within a hold's length of the last one's end (a machine that stays
# busy), up to MAX_HOLD_NICE.  STALL: far above a timer's usual lateness
# under load (under 2 ms), far below what users notice.
STALL = 0.05
HOLD_NICE = 10.0
MAX_HOLD_NICE = 600.0
# How often the routing thread's lateness is measured (and a starved
# writer's progress checked: StoreWriter.check_progress).
WATCH_INTERVAL = 0.2


class Background:
    """A writer thread's place in the scheduler: ``SCHED_IDLE`` while it keeps up, its
    nice value (``SCHED_OTHER``) while it is behind, or for a while after
    routing ran late (:meth:`stalled`).

    :meth:`setup` runs first in the writer thread.  Then either thread may
    call :meth:`behind` (the routing thread, when the writer's backlog
    passes its bound: a starved writer cannot notice that itself) and
    :meth:`caught_up` (the writer, once its backlog is small again); each
    is an attribute test unless the state changes (one system call).
    """

    def __init__(self, nice: int, idle: bool, name: str = "writer") -> None:
        self.nice = nice
        self.name = name  # for the log: "store writer", "routing-log writer"
        # SCHED_IDLE only where the way back is open.
        self.may_idle = idle and may_raise_priority(nice)
        self.idle = False
        self.switches = 0
        self._tid = 0
        # time.monotonic() before which the writer does not go idle, and
        # the length of that hold.
        self._held_until = 0.0
        self._hold = 0.0

    def setup(self) -> None:
        self._tid = threading.get_native_id()
        lower_thread_priority(self.nice)
        self.caught_up()

    def behind(self) -> None:
        if self.idle and self._set(os.SCHED_OTHER):
            self.idle = False

    def caught_up(self) -> None:
        if (self.may_idle and not self.idle and self._tid
                and time.monotonic() >= self._held_until and self._set(os.SCHED_IDLE)):
            self.idle = True

    def stalled(self, now: float) -> float:
        """Routing ran late (``now``: time.monotonic()): the writer keeps its nice
        value for a while (see :data:`STALL`).  Returns the new hold's length
        when the writer was not held, else 0."""
        if not self.may_idle:
            return 0.0
        held = now < self._held_until
        if not held:
            recurring = self._hold and now <= self._held_until + self._hold
            self._hold = min(MAX_HOLD_NICE, 2 * self._hold) if recurring else HOLD_NICE
        self._held_until = max(self._held_until, now + self._hold)
        self.behind()
        return 0.0 if held else self._hold

    def _set(self, policy: int) -> bool:
        try:
            os.sched_setscheduler(self._tid, policy, os.sched_param(0))
        except OSError as exc:
            # EPERM on the way back (the right was dropped since): stay put
            # and stop going idle.
            log.warning("writer thread scheduling: %s; it keeps SCHED_%s", exc,
                        "IDLE" if self.idle else "OTHER")
            self.may_idle = False
            return False
        self.switches += 1
        return True


class StallWatch:
    """One watch of the routing thread's lateness for all the broker's writers.

    Each writer service gives :meth:`add` its :class:`Background` (and a check to
    run at the watch's pace, such as the store's progress check); the
    broker runs :meth:`run` once its services have started.  One timer and
    one log line a stall, whatever the number of writers.
    """

    def __init__(self) -> None:
        self.backgrounds: list[Background] = []
        self.checks: list[Callable[[], None]] = []

    def add(self, background: Background, check: Callable[[], None] | None = None) -> None:
        """Watch for ``background`` (when it may go idle at all), and run ``check``
        every :data:`WATCH_INTERVAL` with it."""
        if background.may_idle:
            self.backgrounds.append(background)
            if check is not None:
                self.checks.append(check)

    async def run(self) -> None:
        """Trio task: every :data:`WATCH_INTERVAL`, whether routing ran late, and the
        checks; returns at once when no writer may go idle.

        The lifecycle starts it before the end of the broker's start (its
        collection and freeze), which are synchronous: its first interval
        begins once they are done, so start-up is never taken for a stall."""
        if not self.backgrounds:
            return
        while True:
            start = trio.current_time()
            await trio.sleep(WATCH_INTERVAL)
            late = trio.current_time() - start - WATCH_INTERVAL
            if late > STALL:
                self.stalled(late)
            for check in self.checks:
                check()

    def stalled(self, late: float) -> None:
        """Routing ran ``late`` seconds late: every writer keeps its nice value for a
        hold (said once a hold, naming the writers whose hold began)."""
        now = time.monotonic()
        holds = [(background.name, background.stalled(now)) for background in self.backgrounds]
        begun = [(name, hold) for name, hold in holds if hold]
        if begun:
            log.info("routing ran %.0f ms late, as the CPUs are busy: writers kept at their "
                     "nice value (not SCHED_IDLE) for %.0f s: %s", late * 1e3,
                     max(hold for _, hold in begun), ", ".join(name for name, _ in begun))
