"""Drive a real Hat peer script (tests/peers/*.py) in its own virtualenv over JSON lines."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
from typing import Any

import trio

from tests.peerenv import peer_python

PEERS = pathlib.Path(__file__).resolve().parent / "peers"


class PeerProcess:
    """One peer subprocess: ``await call(op, **args)`` writes a command, returns its answer."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buf = b""

    @classmethod
    async def start(cls, requirements: tuple[str, ...], script: str, *args: str) -> PeerProcess:
        exe = await trio.to_thread.run_sync(peer_python, requirements)
        process = await trio.lowlevel.open_process(
            [str(exe), str(PEERS / script), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        return cls(process)

    async def line(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buf:
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    raise EOFError(f"peer exited ({self.process.returncode}) "
                                   f"with {self._buf!r} pending")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def call(self, op: str, *, wait: float = 20.0, **args: Any) -> dict[str, Any]:
        """Send one command; ``wait`` bounds the answer (``args`` go to the peer)."""
        assert self.process.stdin is not None
        await self.process.stdin.send_all(json.dumps({"op": op, **args}).encode() + b"\n")
        return await self.line(wait)

    async def aclose(self) -> None:
        with trio.move_on_after(5) as scope:
            with contextlib.suppress(EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                await self.call("close", wait=5)
            await self.process.wait()
        if scope.cancelled_caught:
            self.process.kill()
            await self.process.wait()

    async def __aenter__(self) -> PeerProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
