"""The store's writer in a child process: SQLite's CPU work off the broker's interpreter.

    [store] writer = "process"   # or "thread" (broker/store/writer.py, in the broker)

Why (docs/store.md, "Keeping routing's latency"): the in-thread writer's
SQLite work (binding rows, stepping statements, committing) runs in the
broker's process and, with isolated messages, each wake-up of the routing
thread can land in a wait for the interpreter lock the writer holds.  Here
the broker keeps the queue exactly as before (:meth:`StoreWriter.observe`:
one C-level row per routing batch), and a shipping thread hands everything
queued to the child once per ``flush_interval``: one pickled list per
hand-over (never one pickle per message), length-prefixed, over a pipe.  The
child runs the same :class:`StoreWriter` code (transactions, eviction,
checkpoints, the carry of failed commits) and answers each hand-over with
its reports (committed up to which EventId) and counters; the broker turns
the reports into ``persisted`` notifications as before.  Queries stay in the
broker on their own connection: SQLite's WAL lets a reader in another
process see every committed transaction.

Life cycle: the broker opens and checks the store itself (start-up
refusals, index upgrade, the session reservation) before it starts the
child, so nothing of that changes.  The child dies with the broker: it
reads its requests from a pipe whose EOF ends it at once (after the commit
it may be in: SQLite's WAL stays consistent whatever the moment), leaving
the files as a crash of the broker would (the WAL in place, the store
marked running); only an explicit close request makes it stop gracefully
(final commit, checkpoint, marked clean).  It runs in a
session of its own and ignores SIGINT and SIGTERM, so a signal to the
broker's process group reaches the broker, which then hands over what is
queued and closes the pipe.  A child that dies is logged, its hand-over counted as a failed
commit (its messages reported not persisted, its bridge spool and resume
operations kept and handed over again: they are idempotent), and a new
child is started at the next hand-over, at most once per
:data:`RESPAWN_INTERVAL`; in between, hand-overs fail the same way (routing
goes on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import time

from broker.core.router import Routed
from broker.store.batch_rows import RunBuilder
from broker.store.heap import return_large_frames, trim
from broker.store.store import Store
from broker.store.writer import (
    LOG_INTERVAL,
    LOST,
    RESUME,
    ROW,
    RUN,
    SPOOL_ADD,
    SPOOL_DEL,
    TRIM_BYTES,
    StoreWriter,
)

log = logging.getLogger(__name__)

# Seconds between two starts of the child after it died: a child that
# cannot run (say its interpreter fails to start) must not be restarted in a
# loop that takes the CPU routing needs.
RESPAWN_INTERVAL = 5.0
# Frame bytes of one hand-over (and so of one transaction in the child), at
# most: a hand-over exists three times at its peak (the queued frames, their
# pickled copy, the child's unpickled one), so a burst of large messages
# costs the two processes together about what the thread writer costs (it
# measured +233 MiB against +188 at the peak of 150 x 4 MiB with the thread
# writer's max_bytes / 8 = 8 MiB; docs/store.md).
HANDOVER_BYTES = 2 * 1024 * 1024
# Seconds close() waits for the child's final commit and checkpoint.
CLOSE_TIMEOUT = 60.0
_LEN = struct.Struct("<Q")
# The child's counters the broker mirrors (StoreStats fields it changes).  The
# broker's figure is its own share plus every child's (a new child starts
# from 0: counters must never go back); evicted is the store's own total
# (meta), last_error the newest.
_SUMMED = ("commits", "events_written", "bytes_written", "failed_commits", "failed_events",
           "overload", "spool_retried", "spool_lost", "checkpoints", "checkpoints_busy")
_CHILD_STATS = (*_SUMMED, "evicted", "last_error")


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            raise EOFError("pipe closed")
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def _send(fd: int, obj: object) -> None:
    data = pickle.dumps(obj, protocol=5)
    for part in (_LEN.pack(len(data)), data):  # no copy of the payload to prefix it
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]


def _recv(fd: int) -> object:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    return pickle.loads(_read_exact(fd, n))


def _portable(op: object) -> object:
    """A queued operation the child can unpickle: a routing batch that was not one
    run loses its endpoints (the writer needs only the message's own fields), an
    open run goes as the RUN it is (None: it holds nothing)."""
    if type(op) is list:
        return [(r.frame, r.header, r.delivered, r.session, r.instance, r.timestamp)
                for r in op]
    if type(op) is RunBuilder:
        return op.take()
    return op


# The child's answer to each hand-over: a plain tuple (the child runs as
# __main__, so no class of its own crosses the pipe): reports, counters,
# count, bytes, evicted, evicted_upto, frame bytes taken, carried operations.
_Reply = tuple


class ProcessStore(Store):
    """The store whose commits happen in a child process (see the module's text)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._proc: subprocess.Popen | None = None
        self._to_child = self._from_child = -1
        self._nice = 0
        self._child_carried = 0
        self._last_spawn = -RESPAWN_INTERVAL
        self._last_death_log = -LOG_INTERVAL
        # Counters of children that ended plus the broker's own (_lost), and
        # the running child's last figures.
        self._base = dict.fromkeys(_SUMMED, 0)
        self._child_last = dict.fromkeys(_SUMMED, 0)
        self.own_session = True
        # _take's budget here (the child's transactions follow the hand-overs).
        self.txn_bytes = min(self.txn_bytes, HANDOVER_BYTES)

    # ---- life cycle ----------------------------------------------------------------

    def start(self, call_soon=None, thread_setup=None, nice: int = 0) -> None:
        """Start the child, then the shipping thread (``thread_setup`` runs in the latter;
        ``nice`` is the child's nice increment: [broker] writer_nice)."""
        self._nice = nice
        self._spawn()
        super().start(call_soon, thread_setup)

    def _spawn(self) -> bool:
        self._last_spawn = time.monotonic()
        args = {"directory": self.directory, "size": self.size, "max_bytes": self.max_bytes,
                "max_age": self.max_age, "flush_interval": self.flush_interval,
                "spool_max_bytes": self.spool_max_bytes, "nice": self._nice,
                "log_level": logging.getLogger().getEffectiveLevel()}
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "broker.store.writer_process", repr(args),
                 str(req_r), str(rep_w)],
                pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, close_fds=True,
                # Its own session: signals to the broker's process group
                # (a terminal's Ctrl-C) do not reach it, the pipe's EOF
                # ends it; with Linux's autogroup scheduling, its CPU is
                # not taken from the broker's group (docs/store.md).
                start_new_session=self.own_session)
        except OSError as exc:
            log.error("store %s: cannot start the writer process: %s", self.path, exc)
            self._proc = None
            return False
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._to_child, self._from_child = req_w, rep_r
        try:
            # The child's first message says it opened the store.
            self._apply_reply(_recv(self._from_child))
        except (EOFError, OSError) as exc:
            self._child_died(exc)
            return False
        return True

    def close(self) -> None:
        """Commit everything queued (in the child), stop it, close the reader."""
        self.stop_thread()  # the shipping thread
        if self._proc is None:
            self._last_spawn = -RESPAWN_INTERVAL  # a last child for the final commit
        self.flush()
        if self._proc is not None:
            try:
                # The graceful stop: the child commits its carry, checkpoints,
                # marks the store clean and answers with its final counters.
                _send(self._to_child, None)
                self._apply_reply(_recv(self._from_child))
            except (EOFError, OSError):
                log.error("store %s: the writer process ended without its final report",
                          self.path)
            try:
                self._proc.wait(CLOSE_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.error("store %s: the writer process did not end; killed", self.path)
                self._proc.kill()
                self._proc.wait()
            for fd in (self._to_child, self._from_child):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._proc = None
        if self._carry or self._child_carried:
            log.error("store %s: %d bridge spool operations of failed commits are lost at "
                      "close", self.path, len(self._carry) + self._child_carried)
        self.reader.close()
        self._conn.close()

    def pending(self) -> int:
        return len(self._ops) + len(self._carry) + self._child_carried

    # ---- hand-over (writer's lock held) --------------------------------------------

    def _commit_queued(self) -> None:
        """Hand what is queued now to the child, in hand-overs of at most ``txn_bytes`` of
        frames (one transaction each there: the memory a burst takes on both sides of
        the pipe stays bounded by it), each answered once committed."""
        left = len(self._ops)  # what the routing thread adds meanwhile waits (writer.py)
        taken = self._take(left)
        self._hand_over(taken)
        left -= len(taken)
        while left > 0:
            taken = self._take(left)
            self._hand_over(taken)
            left -= len(taken)

    def _hand_over(self, taken: list) -> None:
        carried = self._carry.take([], [], {})
        ops_out = [(SPOOL_ADD, *a) for a in carried[0]] + [(SPOOL_DEL, *d) for d in carried[1]]
        ops_out += [(RESUME, *r) for r in carried[2].values()]
        ops_out += [op for op in map(_portable, taken) if op is not None]
        if self._proc is None and not (
                time.monotonic() - self._last_spawn >= RESPAWN_INTERVAL and self._spawn()):
            self._lost(ops_out, taken)
            return
        try:
            _send(self._to_child, ops_out)
            self._apply_reply(_recv(self._from_child))
        except (EOFError, OSError) as exc:
            self._child_died(exc)
            self._lost(ops_out, taken)
            return
        except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
            # A message whose decoded header would not pickle: a defect, but one
            # that must not end the shipping thread.  The child may have read part
            # of the hand-over: start a new one.
            log.exception("store %s: a hand-over could not be encoded", self.path)
            self._child_died(exc)
            self._lost(ops_out, taken)
            return
        if self._taken_bytes - self._trimmed_at >= TRIM_BYTES:
            self._trimmed_at = self._taken_bytes
            trim()

    def _apply_reply(self, reply: _Reply) -> None:
        reports, stats, self.count, self.bytes, self.evicted, self.evicted_upto, taken, \
            self._child_carried = reply
        for name in _SUMMED:
            self._child_last[name] = stats[name]
            setattr(self.stats, name, self._base[name] + stats[name])
        self.stats.evicted = stats["evicted"]
        if stats["last_error"]:
            self.stats.last_error = stats["last_error"]
        self._taken_bytes += taken
        self._reports.extend(reports)

    def _count(self, name: str, n: int) -> None:
        self._base[name] += n
        setattr(self.stats, name, getattr(self.stats, name) + n)

    def _child_died(self, exc: BaseException) -> None:
        self.stats.writer_deaths += 1
        for name in _SUMMED:
            self._base[name] += self._child_last[name]
            self._child_last[name] = 0
        proc, self._proc = self._proc, None
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._to_child = self._from_child = -1
        status = None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            status = proc.wait()
        # Its carried spool operations died with it; they were counted as pending.
        self._child_carried = 0
        now = time.monotonic()
        if now - self._last_death_log >= LOG_INTERVAL:
            self._last_death_log = now
            log.error("store %s: the writer process ended (status %s: %s); %d times so far; "
                      "a new one starts at the next commit (at most every %.0f s)", self.path,
                      status, exc, self.stats.writer_deaths, RESPAWN_INTERVAL)

    def _lost(self, ops: list, taken: list) -> None:
        """A hand-over no child committed: its messages are not persisted (counted and
        reported), its spool and resume operations are kept for the next one."""
        # Off the queue all the same (the pending-bytes bound of observe()).
        for op in taken:
            if type(op) is RunBuilder:
                self._taken_bytes += op.nbytes
            elif type(op) is list:
                self._taken_bytes += sum(len(r.frame) for r in op)
            elif op[0] == ROW:
                self._taken_bytes += op[1][8]
            elif op[0] == SPOOL_ADD:
                self._taken_bytes += len(op[5])
        upto = None
        events = 0
        for op in ops:
            if type(op) is list:
                events += len(op)
                last = op[-1]
                eid = (last[3], last[4])
            elif op[0] == ROW:
                row = op[1]
                events += row[2] - row[1] + 1
                eid = (row[0], row[2])
            elif op[0] == RUN:  # (RUN, row, ..., last session, events)
                events += op[6]
                eid = (op[5], op[1][2])
            elif op[0] == LOST:
                self._count("overload", op[3])
                eid = (op[1], op[2])
            else:
                continue
            if upto is None or eid > upto:
                upto = eid
        self._count("failed_commits", 1)
        self._count("failed_events", events)
        self.stats.last_error = "the writer process is not running"
        if upto is not None:
            self._reports.append((upto, False))
        adds = [op[1:] for op in ops if type(op) is tuple and op[0] == SPOOL_ADD]
        dels = [op[1:] for op in ops if type(op) is tuple and op[0] == SPOOL_DEL]
        resume = {op[1]: op[1:] for op in ops if type(op) is tuple and op[0] == RESUME}
        if adds or dels or resume:
            self._count("spool_lost", self._carry.keep(adds, dels, resume))


# ---- the child ---------------------------------------------------------------------

def _state(writer: StoreWriter, taken0: int, reports: list) -> _Reply:
    return (reports, {n: getattr(writer.stats, n) for n in _CHILD_STATS}, writer.count,
            writer.bytes, writer.evicted, writer.evicted_upto, writer._taken_bytes - taken0,
            len(writer._carry))


def _as_routed(op: object) -> object:
    if type(op) is list:
        return [Routed(f, h, None, (), d, s, i, t) for f, h, d, s, i, t in op]
    return op


def child_main(args: dict, req_fd: int, rep_fd: int) -> None:
    # No PR_SET_PDEATHSIG: Linux fires it when the *thread* that started the
    # child ends, and a child restarted by the broker's shipping thread would
    # be killed when that thread ends at close(), before its final commit.
    # The request pipe's EOF is the signal instead: the kernel closes the
    # broker's end when the broker dies however it dies, and only the broker
    # holds it (os.pipe() descriptors are not inherited by other children).
    # SIGINT / SIGTERM sent to the broker's process group must not end the
    # child before the broker's final hand-over: the pipe's EOF ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args["log_level"], stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (writer process): "
                               "%(message)s")
    if args["nice"]:
        with contextlib.suppress(OSError):
            os.nice(args["nice"])
    # The broker's heap hint (broker/store/heap.py) here too: the frames of a
    # burst of large messages arrive unpickled in this process, and must go
    # back to the system after their commit, not stay in the heap.
    return_large_frames()
    writer = StoreWriter(args["directory"], size=args["size"], max_bytes=args["max_bytes"],
                         max_age=args["max_age"], flush_interval=args["flush_interval"],
                         spool_max_bytes=args["spool_max_bytes"], verify=False)
    # The broker wrote the state file with the ceiling it committed
    # (start_session); the writer here keeps it following the ceiling it
    # raises, and marks it clean after the final checkpoint (close()).
    writer._state_ceiling = writer._ceiling
    _send(rep_fd, _state(writer, writer._taken_bytes, []))
    while True:
        try:
            ops = _recv(req_fd)
        except EOFError:
            # The broker died without closing the store (SIGKILL, a crash):
            # leave the files as the thread writer would have left them, the
            # WAL in place and the store marked running, so the next start
            # checks it as after a crash.  (Closing the connection would
            # checkpoint and delete the WAL.)
            os._exit(0)
        if ops is None:
            break  # close(): the graceful stop
        taken0 = writer._taken_bytes
        writer._ops.extend(map(_as_routed, ops))
        writer._commit_queued()
        reports = list(writer._reports)
        writer._reports.clear()
        _send(rep_fd, _state(writer, taken0, reports))
    taken0 = writer._taken_bytes
    writer.close()  # the carry's last try, checkpoint, close
    with contextlib.suppress(OSError):
        _send(rep_fd, _state(writer, taken0, list(writer._reports)))


if __name__ == "__main__":
    import ast

    # Same interpreter and path as the broker (sys.executable -m ...).
    child_main(ast.literal_eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
