"""The main thread's own epoll loop, with trio running as its guest.

Why: with independent publishers (one message per write) every message is
one wake-up, and a wake-up through trio's scheduler costs about 45 µs of CPU
on the benchmark VM where a bare epoll loop costs 16 and this loop 21
(``python -m bench.wakeup_floor``: read and write only, no routing).  A
connection's reader may therefore hand its socket to this loop
(:meth:`HostLoop.serve`): while it is there, each readable
event runs the reader's synchronous step (read, route, deliver) straight
from ``epoll_wait``, with no task switch and no trio scheduler pass.
Anything the step cannot finish alone (end of input, an error, back-
pressure, a slice bound, a timeout to arm) gives the socket back to the
reader's task.

Everything else runs in trio as before, in guest mode
(``trio.lowlevel.start_guest_run``): trio's ticks run on this thread between
the loop's events, and trio waits for its own I/O in a helper thread that
hands each wake-up back here.  Host callbacks and trio ticks never overlap
(one thread), so the routing core stays single-threaded; a host callback may
call trio's synchronous API (``Event.set``, ``reschedule``, cancel scopes):
trio's guest mode wakes itself for a task rescheduled between its ticks.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

# Events taken from one epoll_wait: a bound on the work between two trio
# ticks (each hot event is at most one read and one routing slice).
MAX_EVENTS = 64

# The loop a reader can hand its socket to, in this run (None: plain trio.run).
CURRENT: trio.lowlevel.RunVar[HostLoop | None] = trio.lowlevel.RunVar("host_loop", default=None)


def current() -> HostLoop | None:
    """The host loop of this trio run (None: plain ``trio.run``, or no run)."""
    try:
        return CURRENT.get()
    except RuntimeError:  # not in a trio run
        return None


class HostLoop:
    """Run one trio program as the guest of a level-triggered epoll loop."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._calls: deque[Callable[[], object]] = deque()
        self._watchers: dict[int, Callable[[], None]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._result: outcome.Outcome | None = None
        # Reads served from the loop (the hot path), for the metrics.
        self.hot_reads = 0

    def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``async_fn(*args)`` to completion; its result, or what it raised."""

        async def main() -> Any:
            CURRENT.set(self)
            return await async_fn(*args)

        try:
            trio.lowlevel.start_guest_run(
                main,
                run_sync_soon_threadsafe=self._call_soon_threadsafe,
                run_sync_soon_not_threadsafe=self._calls.append,
                done_callback=self._done,
            )
            self._loop()
        finally:
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        assert self._result is not None
        return self._result.unwrap()

    def _loop(self) -> None:
        calls, watchers, poll = self._calls, self._watchers, self._epoll.poll
        wake_r = self._wake_r
        while self._result is None:
            # The calls queued so far, not those they queue: a trio tick with
            # tasks still runnable queues the next tick, which must wait for
            # the sockets' turn (else a busy trio starves the served sockets).
            for _ in range(len(calls)):
                calls.popleft()()
                if self._result is not None:
                    return
            for fd, _ in poll(0 if calls else -1, MAX_EVENTS):
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 4096):
                            pass
                    continue
                ready = watchers.get(fd)
                if ready is not None:
                    ready()

    def _call_soon_threadsafe(self, fn: Callable[[], object]) -> None:
        self._calls.append(fn)
        # A full pipe means the loop is awake anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _done(self, result: outcome.Outcome) -> None:
        self._result = result

    async def serve(self, fd: int, step: Callable[[], object]) -> object:
        """Run ``step()`` from the loop each time ``fd`` is readable, until it
        returns something other than None; return that (or raise what it raised).

        While served, ``fd`` is not in trio's hands: the caller must not wait
        on it elsewhere, and must not close it before this returns.  Cancelling
        the caller takes ``fd`` back from the loop.
        """
        task = trio.lowlevel.current_task()
        watchers = self._watchers

        def ready() -> None:
            self.hot_reads += 1
            try:
                result: outcome.Outcome | None = None
                value = step()
                if value is not None:
                    result = outcome.Value(value)
            except Exception as exc:
                result = outcome.Error(exc)
            # The step may have cancelled its own task (a connection killed
            # while routing): the abort took fd back and woke the task then.
            if result is not None and watchers.get(fd) is ready:
                self._unwatch(fd)
                trio.lowlevel.reschedule(task, result)

        watchers[fd] = ready
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except BaseException:
            del watchers[fd]
            raise

        def abort(_: object) -> trio.lowlevel.Abort:
            self._unwatch(fd)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def _unwatch(self, fd: int) -> None:
        if self._watchers.pop(fd, None) is not None:
            with contextlib.suppress(OSError):  # already closed: epoll dropped it
                self._epoll.unregister(fd)
