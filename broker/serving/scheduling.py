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
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
import sys
import threading

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
