"""Section 11: what hat-event 0.9.44 Eventer clients observe of the broker
matches what they observe of the REAL hat-event-server 0.9.44 (LMDB backend).

One scripted session (tests/peers/eventer09_session.py: registers with and
without response, subscriptions with ``*`` and ``?``, persisted
notifications, latest, timeseries with paging in both orders by timestamp
and source timestamp, server queries, status) runs once against each server.
Ids and timestamps differ by nature; they are replaced by their ranks (so
their order still counts) before the transcripts are compared step by step.
The deliberate differences that remain are listed in docs/eventer.md
("Differences from hat-event-server"); this test holds none of them.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile
from typing import Any

import pytest

from tests.brokerproc import BrokerProcess
from tests.hatsystem import event_server
from tests.peerenv import EVENTER09_PEER, peer_python

pytestmark = pytest.mark.peers

SESSION = pathlib.Path(__file__).resolve().parents[2] / "peers" / "eventer09_session.py"
SERVER_ID = 1


def run_session(port: int) -> list[list[Any]]:
    exe = peer_python(EVENTER09_PEER)
    out = subprocess.run([str(exe), str(SESSION), str(port), str(SERVER_ID)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["steps"]


def _events(node: Any):
    if isinstance(node, dict):
        if "id" in node and "timestamp" in node:
            yield node
        else:
            for v in node.values():
                yield from _events(v)
    elif isinstance(node, list):
        for v in node:
            yield from _events(v)


def normalise(steps: list[list[Any]]) -> list[list[Any]]:
    """Sessions -> their ranks within the transcript, each timestamp -> the
    rank of its session's first timestamp (hat-event-server stamps a session
    once, the broker each message: docs/eventer.md; the order of timestamps
    within a session is checked apart), latest results in type order (the
    order of hat-event-server's table, not part of the protocol)."""
    for name, result in steps:
        if name.startswith("latest "):
            result["events"].sort(key=lambda e: e["type"])
    events = list(_events(steps))
    sessions = {s: i for i, s in enumerate(sorted({e["id"][1] for e in events}))}
    first: dict[int, float] = {}
    for e in events:
        first[e["id"][1]] = min(first.get(e["id"][1], e["timestamp"]), e["timestamp"])
    stamps = {t: i for i, t in enumerate(sorted(set(first.values())))}
    for e in events:
        e["timestamp"] = stamps[first[e["id"][1]]]
        e["id"] = [e["id"][0], sessions[e["id"][1]], e["id"][2]]
    return steps


def in_order(steps: list[list[Any]]) -> bool:
    """Timestamps never go back in EventId order."""
    seen = {}
    for e in _events(steps):
        seen[tuple(e["id"])] = e["timestamp"]
    stamps = [seen[k] for k in sorted(seen)]
    return stamps == sorted(stamps)


@pytest.fixture(scope="module")
def transcripts():
    with (tempfile.TemporaryDirectory(prefix="hat-event-server-") as tmp,
          event_server(pathlib.Path(tmp), SERVER_ID) as server):
        hat = run_session(server.listen_port)
    with BrokerProcess(f"[broker]\nserver_id = {SERVER_ID}\n") as broker:
        ours = run_session(broker.addr["eventer"][1])
    assert in_order(hat) and in_order(ours)
    return normalise(hat), normalise(ours)


def test_the_same_steps_ran(transcripts):
    hat, ours = transcripts
    assert [name for name, _ in hat] == [name for name, _ in ours]


# Steps whose answers differ on purpose (docs/eventer.md, "Differences from
# hat-event-server"), with what each server answers.
DELIBERATE = {
    # hat-event-server registers events of its own (engine status, each
    # Eventer client's connection); the broker does not.
    "server's own event types": (["event/1"], []),
}


def test_every_step_answers_as_hat_event_server(transcripts):
    hat, ours = transcripts
    differences = [
        f"{name}:\n  hat-event-server: {json.dumps(h)}\n  broker:           {json.dumps(o)}"
        for (name, h), (_, o) in zip(hat, ours, strict=True)
        if h != o and name not in DELIBERATE
    ]
    assert not differences, "\n".join(differences)


def test_the_deliberate_differences_are_what_the_docs_say(transcripts):
    hat, ours = transcripts
    for (name, h), (_, o) in zip(hat, ours, strict=True):
        if name in DELIBERATE:
            assert (h, o) == DELIBERATE[name], name
