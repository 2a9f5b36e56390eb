"""An in-memory NATS server for the pure backplane tests: subject matching and
per-subscription delivery (one copy per matching subscription, as NATS does),
and the interest messages between brokers (``connect()`` says hello for each,
as a fresh NATS connection does; without it every broker publishes everything)."""

from __future__ import annotations

from broker.cluster import subjects
from broker.cluster.backplane import Backplane
from wire import nats


def subject_matches(pattern: bytes, subject: bytes) -> bool:
    p, s = pattern.split(b"."), subject.split(b".")
    for i, tok in enumerate(p):
        if tok == b">":
            return len(s) > i
        if i >= len(s) or (tok != b"*" and tok != s[i]):
            return False
    return len(p) == len(s)


def parse_commands(data: bytes) -> list[tuple[bytes, list[bytes], bytes]]:
    """(op, args, body) for SUB / UNSUB / HPUB / PUB as the backplane writes them."""
    out = []
    pos = 0
    while pos < len(data):
        end = data.index(b"\r\n", pos)
        op, *args = data[pos:end].split()
        pos = end + 2
        body = b""
        if op in (b"PUB", b"HPUB"):
            total = int(args[-1])
            body = data[pos:pos + total]
            assert data[pos + total:pos + total + 2] == b"\r\n"
            pos += total + 2
        out.append((op, args, body))
    return out


class FakeNats:
    def __init__(self, backplanes: list[Backplane]) -> None:
        self.backplanes = backplanes
        self.subs: dict[int, dict[bytes, bytes]] = {i: {} for i in range(len(backplanes))}
        self.published = 0
        self.interest_messages = 0

    def connect(self, now: float = 0.0) -> None:
        """Every backplane gets a fresh connection (at ``now``) and says hello."""
        for bp in self.backplanes:
            bp.connected(now)
        self.pump()

    def pump(self) -> None:
        """Carry every pending command until nothing is left (the routers' batches included)."""
        busy = True
        while busy:
            busy = False
            for i, bp in enumerate(self.backplanes):
                data = bp.take_pending()
                if not data:
                    continue
                busy = True
                for op, args, body in parse_commands(data):
                    if op == b"SUB":
                        self.subs[i][args[-1]] = args[0]
                    elif op == b"UNSUB":
                        self.subs[i].pop(args[0], None)
                    elif op == b"HPUB":
                        self.published += 1
                        self._publish(i, args[0], body, int(args[-2]))
                    elif op == b"PUB" and args[0].startswith(subjects.INTEREST):
                        self.interest_messages += 1
                        for j, other in enumerate(self.backplanes):
                            if j != i:  # echo off
                                other.interest_received(body, 0.0, args[0])

    def _publish(self, origin: int, subject: bytes, body: bytes, hlen: int) -> None:
        for j, bp in enumerate(self.backplanes):
            if j == origin:  # echo off
                continue
            for sid, pattern in list(self.subs[j].items()):
                if subject_matches(pattern, subject):
                    bp.receive(nats.Msg(subject, sid, None, body[hlen:], body[:hlen]))
            bp.router.end_batch()
