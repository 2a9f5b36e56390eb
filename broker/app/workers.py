"""``skan-broker --workers N``: N broker processes on one host, one per core.

Each worker is a whole broker (``python -m broker``) with its own server id
(``[broker] server_id`` + i), routing-log directory (``<log dir>/w<i>``), store
directory (``<store dir>/w<i>``) and
metrics port (the configured one + i, or a free one); all of them bind the
same client ports with SO_REUSEPORT, so the kernel spreads new connections
over the workers, and they route to each other through the cluster
backplane, so a worker count of N needs ``[cluster] url`` (or ``--cluster``).

The parent only supervises: it picks concrete ports when the configuration
says 0 (so every worker binds the same one), prints each listener once when
every worker is up, forwards SIGINT/SIGTERM, and exits with the worst exit
status.  A worker that dies takes the others down with it: an operator's
supervisor (systemd) restarts the whole set, which is simpler to reason
about than a partly running host.
"""

from __future__ import annotations

import os
import pathlib
import selectors
import signal
import socket
import subprocess
import sys
import time

from broker.app.listening import all_listening, print_listening
from broker.serving.config import Config
from broker.store.store import default_dir

# Client listeners shared by every worker (metrics are per worker).
SHARED = ("skan", "hsp", "eventer", "mariner")
START_TIMEOUT = 60.0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_commands(config: Config, argv: list[str], workers: int) -> list[list[str]]:
    """The command line of each worker: the parent's, with per-worker values after it."""
    host = config.broker.host
    shared: list[str] = []
    for name in SHARED:
        section = getattr(config, name)
        if getattr(section, "enabled", True):
            port = section.port or _free_port(host)
            shared += [f"--{name}-port", str(port)]
    log_dir = pathlib.Path(config.log.dir)
    # One store per worker too: a store belongs to one broker (its sessions,
    # its EventIds), and two processes must never open the same one.
    store_dir = pathlib.Path(config.store.dir or default_dir(config.log.dir))
    commands = []
    for i in range(workers):
        metrics = config.metrics.port + i if config.metrics.port else 0
        commands.append([
            sys.executable, "-m", "broker", *argv, *shared,
            "--server-id", str(config.broker.server_id + i),
            "--metrics-port", str(metrics),
            "--log-dir", str(log_dir / f"w{i}"),
            "--store-dir", str(store_dir / f"w{i}"),
            "--reuse-port",
        ])
    return commands


def run_workers(config: Config, argv: list[str], workers: int) -> int:
    """Start the workers, print their listeners once, supervise until a signal or a death."""
    # Each worker in its own process group: a terminal's Ctrl-C reaches it
    # once, forwarded by the parent, not twice (the group's SIGINT and the
    # parent's), which a worker would take as a second stop signal
    # (broker/app/lifecycle.py StopSignals: a shortened drain).
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, bufsize=0, process_group=0)
             for cmd in worker_commands(config, argv, workers)]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def reload(signum: int, _frame: object) -> None:
        # SIGHUP reloads every worker's configuration (docs/security.md).
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, reload)
    lines = _collect_listening(procs)
    if lines is None:
        stop(signal.SIGTERM, None)
        codes = [p.wait() for p in procs]
        print("skan-broker: a worker failed to start", file=sys.stderr)
        return max(codes) or 1
    print_listening(lines)
    while not stopping:
        if any(p.poll() is not None for p in procs):
            print("skan-broker: a worker exited; stopping the others", file=sys.stderr)
            stop(signal.SIGTERM, None)
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    return max(codes)


def _collect_listening(procs: list[subprocess.Popen]) -> list[str] | None:
    """Every worker's ``listening`` lines (shared ports once), or None if one died."""
    sel = selectors.DefaultSelector()
    buffers: dict[int, bytes] = {}
    for i, p in enumerate(procs):
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ, i)
        buffers[i] = b""
    deadline = time.monotonic() + START_TIMEOUT
    done: set[int] = set()
    while len(done) < len(procs) and time.monotonic() < deadline:
        for key, _ in sel.select(0.2):
            i = key.data
            chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                return None
            buffers[i] += chunk
        for i, p in enumerate(procs):
            if p.poll() is not None and i not in done:
                return None
            if i not in done and all_listening(buffers[i]):
                done.add(i)
    if len(done) < len(procs):
        return None
    out: list[str] = []
    for i in range(len(procs)):
        for line in buffers[i].decode().splitlines():
            if line.startswith("listening ") and line not in out:
                out.append(line)
    # Keep draining worker stdout so a worker never blocks on a full pipe.
    for p in procs:
        sel.unregister(p.stdout)
        _drain_in_background(p)
    return out


def _drain_in_background(p: subprocess.Popen) -> None:
    import threading

    def drain() -> None:
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), True)
        while p.stdout.read(65536):
            pass

    threading.Thread(target=drain, daemon=True).start()
