"""How many Python calls the broker's main thread makes per isolated message.

    python -m bench.call_count [--rate 2000] [--seconds 5] [--top 40] [--config FILE]

A broker is started under this module (``python -m bench.call_count`` with
the broker's arguments and ``SKAN_CALL_COUNT_FILE`` set: then it is the
wrapper, not the driver): a profile hook on its main thread counts every
call, Python functions and C functions apart.  The isolated latency probe
(``bench.compare.probe``, one message per write from several publishers)
warms it up, the counts are reset, the probe runs again, and the counts of
that run, divided by the messages the subscriber got, are printed: Python
frames per message first, then C calls, each with its most frequent.

Why calls: each isolated message follows a sleep in ``epoll_wait``, so the
interpreter runs it on cold caches, where a Python frame costs several
times its in-process price (docs/performance.md, "What is left of an
isolated message's cost").  The number of frames per message is the
figure that moves with the code and not with the machine; the hook slows
the broker down, so this prints no times (``bench.run`` measures those).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import runpy
import signal
import sys
import tempfile
from types import FrameType

import trio

_OUT_ENV = "SKAN_CALL_COUNT_FILE"


def _wrap_broker(out: str) -> None:
    """Run the broker (``python -m broker`` with this process's arguments),
    counting the main thread's calls; SIGUSR1 writes the counts to ``out``
    (JSON) and starts them again."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code
            counts["py", f"{code.co_filename}:{code.co_firstlineno} {code.co_name}"] += 1
        elif event == "c_call":
            counts["c", getattr(arg, "__qualname__", repr(arg))] += 1

    def dump(*_: object) -> None:
        sys.setprofile(None)  # the hook must not count (or change) what it writes
        snapshot = [[kind, name, n] for (kind, name), n in counts.items()]
        counts.clear()
        pathlib.Path(out).write_text(json.dumps(snapshot))
        sys.setprofile(hook)

    signal.signal(signal.SIGUSR1, dump)
    sys.setprofile(hook)
    sys.argv[0] = "broker"
    runpy.run_module("broker", run_name="__main__")


async def _drive(args: argparse.Namespace) -> None:
    from bench.compare import Target, probe
    from bench.skan_load import Broker, SkanClient

    out = pathlib.Path(tempfile.mkdtemp(prefix="skan-call-count-")) / "counts.json"
    config = pathlib.Path(args.config).read_text() if args.config else ""
    broker = Broker(config, env={_OUT_ENV: str(out)}, module="bench.call_count")
    with broker:
        assert broker.proc is not None
        target = Target("skan", SkanClient(broker), broker.cpu_seconds, None)
        got: list[int] = []
        for _ in range(2):  # a warm-up run, then the counted one
            got.clear()
            await probe(target, args.rate, args.seconds, lambda s, r: got.append(r),
                        "isolated")
            os.kill(broker.proc.pid, signal.SIGUSR1)
            with trio.fail_after(10):
                while not out.exists() or not out.stat().st_size:
                    await trio.sleep(0.05)
            counts = json.loads(out.read_text())
            out.unlink()
    messages = len(got)
    print(f"{messages} isolated messages at {args.rate} msgs/s; calls on the broker's "
          f"main thread per message:")
    for kind, title in (("py", "Python frames"), ("c", "C calls")):
        rows = sorted(((n, name) for k, name, n in counts if k == kind), reverse=True)
        total = sum(n for n, _ in rows)
        print(f"\n{title}: {total / messages:.1f} per message")
        for n, name in rows[:args.top]:
            if n / messages < 0.05:
                break
            print(f"  {n / messages:6.2f}  {name.replace(os.getcwd() + '/', '')}")


def main() -> None:
    out = os.environ.get(_OUT_ENV)
    if out:
        _wrap_broker(out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=2000,
                        help="messages per second (low: the hook slows the broker)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=40, help="most frequent calls shown")
    parser.add_argument("--config", help="broker TOML (default: the defaults)")
    trio.run(_drive, parser.parse_args())


if __name__ == "__main__":
    main()
