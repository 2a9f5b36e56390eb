"""Run a real third-party peer script in its own virtualenv and talk JSON lines with it.

The script (under tests/peers/) prints one JSON object per line on stdout;
the test reads them with :meth:`PeerProcess.line` and may write JSON command
lines to the script's stdin with :meth:`PeerProcess.send`.  stderr goes to a
file whose tail is shown when a read times out.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile
from typing import Any

import trio

from tests.peerenv import peer_python

PEERS = pathlib.Path(__file__).resolve().parent / "peers"


class PeerProcess:
    def __init__(self, proc: trio.Process, stderr_path: pathlib.Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self._buf = b""

    @classmethod
    async def start(cls, requirements: tuple[str, ...], script: str, *args: str) -> PeerProcess:
        python = peer_python(requirements)
        stderr_path = pathlib.Path(tempfile.mkstemp(prefix="peer-", suffix=".err")[1])
        with open(stderr_path, "wb") as err:
            proc = await trio.lowlevel.open_process(
                [str(python), "-u", str(PEERS / script), *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )
        return cls(proc, stderr_path)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def line(self, timeout: float = 10.0) -> Any:
        """The next JSON line; EOFError when the script ended."""
        assert self.proc.stdout is not None
        try:
            with trio.fail_after(timeout):
                while b"\n" not in self._buf:
                    data = await self.proc.stdout.receive_some(65536)
                    if not data:
                        raise EOFError("peer exited:\n" + self.stderr()[-3000:])
                    self._buf += data
        except trio.TooSlowError:
            raise trio.TooSlowError("no line from the peer in time:\n"
                                    + self.stderr()[-3000:]) from None
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    async def line_with(self, key: str, timeout: float = 10.0) -> Any:
        """Skip lines until one holding ``key``; return its value."""
        with trio.fail_after(timeout):
            while True:
                msg = await self.line(timeout)
                if key in msg:
                    return msg[key]

    async def send(self, command: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps(command).encode() + b"\n")

    async def aclose(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
        with trio.move_on_after(5) as scope:
            await self.proc.wait()
        if scope.cancelled_caught:
            self.proc.kill()
            await self.proc.wait()
        self.stderr_path.unlink(missing_ok=True)

    async def __aenter__(self) -> PeerProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
