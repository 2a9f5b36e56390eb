"""Real nats-server processes for the cluster tests: one server or a routed cluster."""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.debian import ensure_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nats-server did not listen on {port}")


class NatsNode:
    def __init__(self, binary: str, workdir: pathlib.Path, name: str, cluster_port: int,
                 routes: list[int], args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.args = args  # more nats-server flags (authentication, TLS)
        self.name = name
        self.port = free_port()
        self.cluster_port = cluster_port
        self.routes = routes
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsNode:
        cmd = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-n", self.name,
               "-l", str(self.log)]
        if self.cluster_port:
            cmd += ["--cluster_name", "skan", "--cluster",
                    f"nats://127.0.0.1:{self.cluster_port}"]
            if self.routes:
                cmd += ["--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        cmd += list(self.args)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class NatsCluster:
    """``size`` nats-server nodes routed to each other (size 1: a lone server)."""

    def __init__(self, size: int = 1, args: tuple[str, ...] = ()) -> None:
        binary = ensure_binary("nats-server", "nats-server")
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="skan-nats-"))
        cports = [free_port() for _ in range(size)] if size > 1 else [0]
        self.nodes = [
            NatsNode(binary, self.dir, f"n{i}", cports[i] if size > 1 else 0,
                     [p for j, p in enumerate(cports) if j != i] if size > 1 else [], args)
            for i in range(size)
        ]

    def __enter__(self) -> NatsCluster:
        for node in self.nodes:
            node.start()
        if len(self.nodes) > 1:
            self.wait_routes()
        return self

    def wait_routes(self, timeout: float = 10.0) -> None:
        """Until every node logs a route to each other node."""
        want = len(self.nodes) - 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(_routes(n) >= want for n in self.nodes if n.proc and n.proc.poll() is None):
                return
            time.sleep(0.1)
        raise RuntimeError("nats cluster routes did not form")

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _routes(node: NatsNode) -> int:
    try:
        text = node.log.read_text()
    except OSError:
        return 0
    return text.count("Route connection created")


def cluster_broker(server_id: int, *urls: str, extra: str = "",
                   args: tuple[str, ...] = (), workdir: pathlib.Path | None = None,
                   cluster: str = "") -> BrokerProcess:
    """A broker with ``server_id`` on the NATS ``urls``, quick to reconnect and to start.

    ``extra`` is TOML placed right after ``[broker] server_id``: more
    ``[broker]`` keys, or whole sections of their own; ``cluster``: more
    ``[cluster]`` keys (credentials).
    """
    url = ", ".join(f'"{u}"' for u in urls)
    return BrokerProcess(
        f"[broker]\nserver_id = {server_id}\n{extra}[cluster]\nurl = [{url}]\n"
        "backoff_initial = 0.05\nbackoff_max = 0.5\nid_probe_timeout = 0.3\n"
        f"heartbeat = 0.2\n{cluster}", args=args, workdir=workdir,
    )


async def wait_cluster(client: SkanClient, brokers: int, *, known: bool = False,
                       timeout: float = 5.0) -> dict:
    """Until the client's broker has seen ``brokers`` brokers (heartbeats every
    0.2 s in these tests) and, with ``known``, knows every other one's interest
    (the blind window after connecting is two heartbeats); its cluster stats."""
    with trio.fail_after(timeout):
        while True:
            cluster = (await client.stats())["cluster"]
            if cluster["brokers_seen"] == str(brokers) and (
                    not known or cluster["interest"] == "known"):
                return cluster
            await trio.sleep(0.05)


async def send_until_received(pub: SkanClient, sub: SkanClient, group: str, text: str, *,
                              timeout: float, poll: float) -> None:
    """Publish ``text`` on ``group`` until ``sub`` receives it (a new subscription
    reaches another broker asynchronously)."""
    with trio.fail_after(timeout):
        while True:
            await pub.send(group, text)
            with trio.move_on_after(poll):
                assert (await sub.receive()).msg == text.encode()
                return


def permissions_conf(brokers: dict[int, str], others: str = "") -> str:
    """A nats-server configuration giving broker ``id`` (user ``broker-<id>``,
    password ``brokers[id]``) publish rights on its own subjects only
    (docs/cluster.md, "Per-broker NATS permissions"); ``others``: more user
    entries."""
    users = "\n".join(
        f"""    {{user: "broker-{sid}", password: "{pw}", permissions: {{
      publish: {{allow: ["sk.{sid}.>", "skc.*.{sid}"]}}
      subscribe: {{allow: ["sk.>", "skc.>", "_INBOX.>"]}}
      allow_responses: true
    }}}}""" for sid, pw in brokers.items())
    return f"authorization {{\n  users = [\n{users}\n{others}  ]\n}}\n"
