"""The ``skan`` command-line client as a subprocess: a subscriber and its output."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

import trio

# Seconds a test waits for the client to subscribe or to print what it was sent.
WAIT = 20


async def start_subscriber(command: Sequence[str], env: Mapping[str, str]) -> trio.Process:
    """Start ``command`` (a ``skan ... sub``) and return once it has said on
    stderr that its subscription is in place."""
    proc = await trio.lowlevel.open_process(list(command), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env=dict(env))
    said = b""
    with trio.fail_after(WAIT):
        while b"subscribed" not in said:
            chunk = await proc.stderr.receive_some(1024)
            if not chunk:
                raise AssertionError(f"the subscriber ended before subscribing: {said!r}")
            said += chunk
    return proc


async def read_lines(proc: trio.Process, n: int) -> list[str]:
    """The first ``n`` lines ``proc`` prints (fewer if it ends first), once it has exited."""
    out = b""
    with trio.fail_after(WAIT):
        while out.count(b"\n") < n:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                break
            out += chunk
    await proc.wait()
    return out.decode().splitlines()
