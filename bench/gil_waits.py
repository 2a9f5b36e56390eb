"""Who holds the interpreter (the GIL) in a running broker, and who waits for it.

    python -m bench.gil_waits [--config FILE] [--seconds 4] [--shape isolated]
                              [--seams]

Starts a broker, drives the latency probe of ``bench.compare`` (``isolated``:
ten publishers taking turns, one message per write, 10,000 msgs/s), and
records uprobes on CPython's ``take_gil`` (entry and return) and
``drop_gil`` in the broker's process with ``perf``.  For each thread it
prints how often it took the GIL, how long it waited for it and how long it
held it (p50, p90, p99, max, and how many waits or holds a second passed
0.1 ms).  The routing thread's waits are what the other threads cost an
isolated message; a writer's long holds are where they come from.

``--seams`` also records the store writer's holds with their C stacks at
both ends (``perf record --call-graph dwarf``) and prints the longest kinds
of hold by where they began and ended (a SQLite call, ``time.sleep``,
``os.sched_yield``...): the Python between two of those seams.

Needs ``perf`` with uprobes (root, or perf_event_paranoid allowing it) and
a CPython with symbols for ``take_gil``/``drop_gil`` (pyenv's and Debian's
have them).  The probes cost a few microseconds per GIL hand-over, so the
figures are for comparing threads and trees in one run, not absolute.
docs/store.md, "The writer's hold on the GIL", has what it found.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile

import trio

from bench.compare import Target, probe
from bench.skan_load import Broker, SkanClient

_GROUP = "skan_gil"
_EVENTS = ("take_gil", "take_gil__return", "drop_gil")
# A wait or hold this long (microseconds) is counted apart: at 10,000
# msgs/s one message arrives every 100 us.
LONG_US = 100.0


def _libpython() -> str:
    """The file holding the interpreter's take_gil: libpython, or the executable."""
    lib = pathlib.Path(sysconfig.get_config_var("LIBDIR") or "",
                       sysconfig.get_config_var("LDLIBRARY") or "")
    return str(lib) if lib.suffix.startswith(".so") and lib.exists() else sys.executable


def _perf(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["perf", *args], capture_output=True, text=True, check=check)


def add_probes() -> None:
    remove_probes()
    lib = _libpython()
    # perf names a return probe EVENT__return itself.
    for spec in ("take_gil", "take_gil%return", "drop_gil"):
        _perf("probe", "-x", lib, "-a", f"{_GROUP}:{spec.split('%')[0]}={spec}")


def remove_probes() -> None:
    _perf("probe", "-d", f"{_GROUP}:*", check=False)


def thread_names(pid: int) -> dict[int, str]:
    """Each thread of the broker by what tells them apart: the routing thread is the
    process's first; the writers run under SCHED_IDLE (policy 5) at their nice."""
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = pathlib.Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1]
        f = fields.split()
        policy, nice = f[38], f[16]
        if int(tid) == pid:
            names[int(tid)] = "routing"
        elif policy == "5":
            names[int(tid)] = f"idle, nice {nice}"
        else:
            names[int(tid)] = f"other {tid}"
    return names


def _events(data: str, fields: str) -> str:
    return _perf("script", "-i", data, "-F", fields).stdout


def summarise(data: str, names: dict[int, str], seconds: float) -> None:
    started: dict[int, float] = {}
    held: dict[int, float] = {}
    waits: dict[str, list[float]] = collections.defaultdict(list)
    holds: dict[str, list[float]] = collections.defaultdict(list)
    for line in _events(data, "tid,time,event").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        tid, ts, event = int(parts[0]), float(parts[1].rstrip(":")), parts[2]
        name = names.get(tid, f"other {tid}")
        if event.endswith(":drop_gil:"):
            if tid in held:
                holds[name].append((ts - held.pop(tid)) * 1e6)
        elif event.endswith(":take_gil__return:"):
            held[tid] = ts
            if tid in started:
                waits[name].append((ts - started.pop(tid)) * 1e6)
        elif event.endswith(":take_gil:"):
            started[tid] = ts
    print(f"{'thread':<16} {'':5} {'per s':>7} {'p50 us':>7} {'p90':>7} {'p99':>7} "
          f"{'max':>7} {'>0.1 ms/s':>10} {'ms/s':>7}")
    for what, table in (("waits", waits), ("holds", holds)):
        for name in sorted(table):
            v = sorted(table[name])
            n = len(v)
            print(f"{name:<16} {what:5} {n / seconds:>7.0f} {v[n // 2]:>7.1f} "
                  f"{v[int(n * 0.9)]:>7.1f} {v[int(n * 0.99)]:>7.1f} {v[-1]:>7.0f} "
                  f"{sum(x > LONG_US for x in v) / seconds:>10.0f} "
                  f"{sum(v) / seconds / 1e3:>7.1f}")


# Frames of the GIL's own machinery, left out of a seam's description.
_MACHINERY = re.compile(r"(take_gil|drop_gil|PyEval_\w+|_PyEval_\w+|\[unknown\])")


def seams(data: str) -> None:
    out = _events(data, "time,event,ip,sym")
    events = []
    for block in out.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        head = re.match(r"(\S+):\s+\S+:(\S+):", lines[0]) if lines else None
        if head is None:
            continue
        # Each frame line: its address, then the symbol (and "(inlined)").
        frames = [line.split(None, 1)[-1].split("+")[0] for line in lines[1:] if " " in line]
        where = " < ".join([f for f in frames if not _MACHINERY.match(f)][:3])
        events.append((float(head[1]), head[2], where or "?"))
    kinds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    start: tuple[float, str] | None = None
    for ts, event, where in events:
        if event == "take_gil__return":
            start = (ts, where)
        elif event == "drop_gil" and start is not None:
            kinds[start[1], where].append((ts - start[0]) * 1e6)
            start = None
    print("\nthe store writer's holds, by the seams they ran between (longest first):")
    ranked = sorted(kinds.items(), key=lambda kv: -sum(x > LONG_US for x in kv[1]))
    for (began, ended), v in ranked[:8]:
        v.sort()
        print(f"  {len(v):6d} holds, {sum(x > LONG_US for x in v):5d} over 0.1 ms, "
              f"median {v[len(v) // 2]:.0f} us, max {v[-1]:.0f} us\n"
              f"      from {began}\n      to   {ended}")


async def main(args: argparse.Namespace) -> None:
    config = pathlib.Path(args.config).read_text() if args.config else ""
    tmp = tempfile.mkdtemp(prefix="skan-gil-")
    data, stacks = os.path.join(tmp, "gil.data"), os.path.join(tmp, "seams.data")
    add_probes()
    try:
        with Broker(config) as broker:
            assert broker.proc is not None
            pid = broker.proc.pid
            target = Target("skan", SkanClient(broker, "skan"), broker.cpu_seconds, None)
            await probe(target, args.rate, 2.0, lambda s, g: None, args.shape)  # warm-up
            names = thread_names(pid)
            events = [a for e in _EVENTS for a in ("-e", f"{_GROUP}:{e}")]

            def perf_record(*cmd: str) -> None:
                subprocess.run(["perf", "record", "-q", *cmd], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               check=False)

            async def record() -> None:
                await trio.sleep(0.5)
                await trio.to_thread.run_sync(
                    perf_record, "-o", data, *events, "-p", str(pid),
                    "--", "sleep", str(args.seconds))
                if args.seams:
                    writer = [t for t, n in names.items() if n == f"idle, nice {args.writer_nice}"]
                    if writer:
                        await trio.to_thread.run_sync(
                            perf_record, "--call-graph", "dwarf,16384", "-o", stacks, *events,
                            "-t", str(writer[0]), "--", "sleep", "3")

            latencies: list[int] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(record)
                await probe(target, args.rate, args.seconds + (4.5 if args.seams else 1.0),
                            lambda sent, got: latencies.append(got - sent), args.shape)
        latencies.sort()
        n = len(latencies)
        print(f"{args.shape}, {args.rate} msgs/s: p50 {latencies[n // 2] / 1e6:.3f} ms, "
              f"p99 {latencies[int(n * 0.99)] / 1e6:.3f} (under the probes)")
        if not os.path.exists(data):
            raise SystemExit("perf recorded nothing: are uprobes allowed here (root, "
                             "kernel.perf_event_paranoid)?")
        summarise(data, names, args.seconds)
        if args.seams and os.path.exists(stacks):
            seams(stacks)
    finally:
        remove_probes()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="TOML config for the broker")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds recorded")
    ap.add_argument("--rate", type=int, default=10_000)
    ap.add_argument("--shape", default="isolated", choices=("isolated", "latency"))
    ap.add_argument("--seams", action="store_true",
                    help="also the store writer's holds by where they began and ended")
    ap.add_argument("--writer-nice", type=int, default=10,
                    help="the store writer's nice ([broker] writer_nice), to find its thread")
    trio.run(main, ap.parse_args())
