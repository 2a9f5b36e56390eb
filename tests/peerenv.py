"""Virtualenvs for real third-party peers whose dependencies clash with ours.

Each peer set (e.g. ``hat-event==0.9.44``) gets its own virtualenv under
``$SKAN_PEER_CACHE`` (default ``~/.cache/skan-broker/peer-venvs``), keyed by a
hash of the requirement list, created on first use and reused by later runs
and later clones on the same machine.  A file lock serialises creation so two
test processes never build the same venv at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import subprocess
import sys

CACHE = pathlib.Path(
    os.environ.get("SKAN_PEER_CACHE", pathlib.Path.home() / ".cache/skan-broker/peer-venvs")
)

# Known peer sets, named once so tests and docs agree on the exact pins.
HSP_PEER = ("hsp==0.1.0", "trio")
EVENTER09_PEER = ("hat-event==0.9.44",)
HAT08_PEER = ("hat-chatter==0.5.11", "hat-event==0.8.17")
# hat-event-server 0.9.44 (``python -m hat.event.server``, LMDB backend) ships in
# the hat-event package itself: the same venv as the 0.9.44 Eventer clients, so
# the differential test against it builds nothing more.
HAT_SERVER_PEER = EVENTER09_PEER
# A real Hat system: hat-gateway (its Modbus master device), hat-monitor for
# the gateway's monitor mode, hat-event 0.9.44 clients and hat-drivers (the
# simulated Modbus slave), pinned to the versions resolved together.
HAT_GATEWAY_PEER = ("hat-gateway==0.6.48", "hat-event==0.9.44", "hat-monitor==0.8.23",
                    "hat-drivers==0.10.10")


def peer_python(requirements: tuple[str, ...], python: str = sys.executable) -> pathlib.Path:
    """Return the interpreter of a virtualenv holding ``requirements``, creating it if needed."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:12]
    name = requirements[0].split("==")[0] + "-" + key
    root = CACHE / name
    exe = root / "bin" / "python"
    stamp = root / ".complete"
    if stamp.exists():
        return exe
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / (name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            subprocess.run([python, "-m", "venv", "--clear", str(root)], check=True)
            subprocess.run(
                [str(exe), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 *requirements],
                check=True,
            )
            stamp.write_text("\n".join(requirements) + "\n")
    return exe
