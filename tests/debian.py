"""Debian packages the tests need (Prometheus, nats-server): installed when missing."""

from __future__ import annotations

import os
import shutil
import subprocess


def ensure_binary(binary: str, package: str) -> str:
    """Path of ``binary``; installs the Debian ``package`` when it is missing.

    Raises RuntimeError (never skips) when it is missing and cannot be installed.
    """
    for candidate in (shutil.which(binary), f"/usr/bin/{binary}", f"/usr/sbin/{binary}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    cmd = f"apt-get update && apt-get install -y -o DPkg::Lock::Timeout=300 {package}"
    if os.geteuid() != 0:
        raise RuntimeError(f"{binary} is not installed and this is not root; run: {cmd}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Other jobs may hold the dpkg lock for a while: the timeout waits for it.
    result = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True,
                            timeout=900)
    for candidate in (shutil.which(binary), f"/usr/bin/{binary}", f"/usr/sbin/{binary}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"installing {package} failed ({cmd}):\n{result.stdout[-3000:]}\n"
                       f"{result.stderr[-3000:]}")
