"""The Chatter schemas: not compiled while a broker starts, compiled aside once it is up.

hat-sbs's import and the schemas' parse took 0.45 s of every broker start;
done on first use instead, they would hold the routing thread (and every
connection) when the first Chatter peer arrives.  The broker runs in a fresh
interpreter here: this test process has long imported hat-sbs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.brokerproc import ROOT

SCRIPT = textwrap.dedent("""
    import sys
    import trio
    from broker.app import lifecycle
    from broker.serving.config import from_mapping
    from wire.chatter import sbs

    work = sys.argv[1]
    ports = {s: {"port": 0} for s in ("skan", "hsp", "eventer", "mariner", "metrics")}
    dirs = {"log": {"dir": work + "/log"}, "store": {"dir": work + "/store"}}
    config = from_mapping({**ports, **dirs})
    at_ready = []

    def ready(lines):
        at_ready.append(("hat.sbs" in sys.modules, sbs._schemas.cache_info().currsize))

    async def main():
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: lifecycle.run(config, ready=ready, stop=stop))
            with trio.fail_after(30):
                while not at_ready:
                    await trio.sleep(0.01)
                while not sbs._schemas.cache_info().currsize:  # no Chatter peer came
                    await trio.sleep(0.01)
            stop.set()
        print(at_ready[0])

    trio.run(main)
""")


def test_a_broker_compiles_the_chatter_schemas_after_it_is_up(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # At ready: hat-sbs not even imported, nothing compiled; then compiled aside.
    assert proc.stdout.strip() == "(False, 0)", proc.stdout
