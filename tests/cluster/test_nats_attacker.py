"""An attacker with access to the NATS server (issue 27): every forged message
the issue lists, and a seeded fuzz of every backplane subject, against two real
brokers on a real nats-server, while a bystander publisher/subscriber pair on
each broker must lose nothing and never stall.

The attacker is a raw NATS client (tests/cluster/rawnats.py): any subject, any
header, any payload.  Here the NATS server grants everyone everything (what
per-broker permissions stop is tested in test_nats_permissions.py), so these
tests show what a broker itself refuses.
"""

from __future__ import annotations

import os
import random
import struct
import time

import pytest
import trio

from broker.cluster import cluster_query as cq
from broker.cluster.backplane import HELLO_INTERVAL
from clients.skan import SkanClient
from tests.cluster.natsproc import NatsCluster, cluster_broker, send_until_received, wait_cluster
from tests.cluster.rawnats import RawNats, run
from tests.examples import LONG
from tests.hardening.bystander import bystander, load_factor, tracebacks
from tests.serving.test_limits import metric_samples, sample
from toolkit.eventer_client import EventerClient
from wire import eventer as w
from wire import nats
from wire.skan import encode_frame

pytestmark = pytest.mark.trio

# Messages of the seeded fuzz: a few hundred by default, many more with SKAN_FUZZ=long.
FUZZ_COUNT = 5000 if LONG else 300
FUZZ_SEED = int(os.environ.get("SKAN_FUZZ_SEED", "27"))
# A bystander may not stall longer than this (scaled by the machine's load).
STALL_MS = 250.0


def frame(sender: str, group: str = "g", instance: str = "i", to: str = "*",
          msg: bytes = b"forged", seq: int = 1, **more: str) -> bytes:
    return encode_frame({"type": "send", "from": sender, "to": to, "group": group,
                         "instance": instance, "seq": str(seq), "msg": msg, **more})


async def cluster_stats(client: SkanClient) -> dict:
    return (await client.stats())["cluster"]


async def until_stat(client: SkanClient, key: str, at_least: int, timeout: float = 10.0) -> int:
    with trio.fail_after(timeout):
        while True:
            value = int((await cluster_stats(client))[key])
            if value >= at_least:
                return value
            await trio.sleep(0.05)


async def receive_texts(sub: SkanClient, want: set[bytes], timeout: float = 10.0) -> None:
    """Until every message of ``want`` arrived (others are skipped)."""
    left = set(want)
    with trio.fail_after(timeout):
        while left:
            left.discard((await sub.receive()).msg)


def interest_full(server: int, seq: int, groups: list[bytes], part: int, parts: int) -> bytes:
    return (b"SKI %d %d full %d %d\n" % (server, seq, part, parts)
            + b"".join(g + b"\n" for g in groups))


def announce(server: int, count: int, part_groups: int = 20_000) -> tuple[bytes, int]:
    """PUBs of a full set of ``count`` groups from ``server`` (in parts), and the last seq."""
    groups = [b"grp%07d" % i for i in range(count)]
    chunks = [groups[i:i + part_groups] for i in range(0, count, part_groups)]
    out = [nats.pub(b"skc.int.%d" % server, interest_full(server, i + 1, chunk, i, len(chunks)))
           for i, chunk in enumerate(chunks)]
    return b"".join(out), len(chunks)


def fuzz(rng: random.Random, count: int) -> list[bytes]:
    """Seeded random messages on every backplane subject: valid shapes with
    random damage, and plain noise."""
    lname = "0_1@fuzz/1"
    good_run = run(b"sk.1.fz.i._", 1, 1, [frame(lname, "fz")])
    hb = b'{"server": 1, "boot": "0123456789abcdef"}'
    numbers = [b"0", b"1", b"-1", b"1e999", b"NaN", b"9" * 25, b"18446744073709551616",
               b"9223372036854775807", b"3.5", b"true", b"null", b"[]", b"{}", b'"1"']

    def damage(data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            if op == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1 and data:
                del data[rng.randrange(len(data)):]
            elif op == 2:
                data[rng.randrange(len(data) + 1):0] = rng.choice(numbers)
            else:
                data += rng.randbytes(rng.randrange(64))
        return bytes(data)

    def run_header() -> bytes:
        parts = [rng.choice([*numbers, b"%d" % rng.randrange(2**64)]) for _ in range(4)]
        parts.append(rng.choice([b"*", b"~", b"alice", b"%zz", b"a b"]))
        return b"NATS/1.0\r\nSkan-Run: " + b" ".join(parts) + b"\r\n\r\n"

    out = []
    for _ in range(count):
        kind = rng.randrange(9)
        server = rng.choice([1, 2, 3, 7, 2**63 - 1])
        if kind == 0:  # a run with a random header
            stamps = struct.pack("<d", rng.choice([1.7e9, float("nan"), float("inf"), -1.0]))
            out.append(nats.hpub(b"sk.%d.fz.i._" % server, run_header(),
                                 stamps + frame(lname, "fz")))
        elif kind == 1:  # a damaged run
            head, body = good_run.split(b"\r\n", 1)
            subject = head.split()[1]
            payload = damage(body[:-2])
            hlen = min(len(payload), int(head.split()[-2]))
            out.append(nats.hpub(subject, payload[:hlen], payload[hlen:]))
        elif kind == 2:  # heartbeats
            out.append(nats.pub(b"skc.hb.%d" % server, damage(hb) if rng.random() < 0.7 else hb))
        elif kind == 3:  # interest messages
            body = rng.choice([b"SKI %d 1 hello 0 1\ng\n", b"SKI %d 5 + \ng\n",
                               b"SKI %d 2 full 0 2\na\nb\n", b"SKI %d 1 - \n>\n"]) % server
            out.append(nats.pub(b"skc.int.%d" % server, damage(body)))
        elif kind == 4:  # queries
            request = cq.encode_request(w.QueryTimeseriesParams(), b"~")
            out.append(nats.pub(b"skc.query.%d" % server, damage(request),
                                b"_INBOX.fuzz.%d" % rng.randrange(1000)))
        elif kind == 5:  # pings and id probes
            subject = rng.choice([b"skc.ping.%d", b"skc.id.%d"]) % server
            out.append(nats.pub(subject, rng.randbytes(rng.randrange(16)), b"_INBOX.fuzz.p"))
        elif kind == 6:  # answers to inboxes nobody asked on
            out.append(nats.pub(b"_INBOX.fuzz.a", rng.randbytes(rng.randrange(64))))
        elif kind == 7:  # noise on subjects of the scheme
            subject = rng.choice([b"sk.1", b"sk.x.fz.i._", b"skc.hb", b"skc.int.x", b"sk.1.fz"])
            out.append(nats.pub(subject, rng.randbytes(rng.randrange(128))))
        else:  # headers that are not NATS/1.0
            out.append(nats.hpub(b"sk.2.fz.i._", b"NATS/1.0\r\n" + rng.randbytes(20)
                                 + b"\r\n\r\n", rng.randbytes(rng.randrange(64))))
    return out


async def test_no_message_from_nats_stops_stalls_or_silences_a_broker(tmp_path):
    conf = tmp_path / "nats.conf"
    # max_payload raised: a frame over the brokers' max_frame (8 MiB) crosses NATS.
    conf.write_text("max_payload: 16MB\nmax_pending: 256MB\n")
    with NatsCluster(1, ("-c", str(conf))) as cluster:
        url = cluster.nodes[0].url
        with cluster_broker(1, url) as a, cluster_broker(2, url) as b:
            async with SkanClient.connect(*a.skan) as pub, SkanClient.connect(*b.skan) as sub, \
                    SkanClient.connect(*a.skan) as watch_a, SkanClient.connect(*b.skan) as watch_b:
                await sub.subscribe("g")
                await sub.subscribe("fz")
                await wait_cluster(watch_a, 2, known=True, timeout=20)
                await wait_cluster(watch_b, 2, known=True, timeout=20)
                await send_until_received(pub, sub, "g", "warm", timeout=10, poll=0.3)
                attacker = await RawNats.open(url)
                await attacker.send(nats.sub(b"skc.int.*", b"1"))
                await attacker.flush()
                before_b = await cluster_stats(watch_b)
                # Every attack built beforehand: the bystanders share this
                # process, and building 300,000 groups must not stall them.
                hellos = b"".join(nats.pub(b"skc.int.7", b"SKI 7 %d hello 0 1\n" % (i + 1))
                                  for i in range(2000))
                big, big_seq = announce(8, 300_000)
                fine, fine_seq = announce(9, 90_000)
                deltas = [nats.pub(b"skc.int.8", b"SKI 8 %d + \nd%d\n" % (big_seq + i + 1, i))
                          + nats.pub(b"skc.int.9", b"SKI 9 %d %s \ngrp%07d\n" % (
                              fine_seq + i + 1, b"-" if i % 2 else b"+", i))
                          for i in range(1000)]
                huge = run(b"sk.1.g.i._", 1, 7, [frame("0_1@host/1", msg=b"x" * (10 << 20))])
                batch = fuzz(random.Random(FUZZ_SEED), FUZZ_COUNT)
                async with bystander(a.skan, group="bystander-a") as by_a, \
                        bystander(b.skan, group="bystander-b") as by_b:
                    async with by_a.measure(), by_b.measure():
                        # One heartbeat that killed both brokers (OverflowError).
                        await attacker.send(
                            nats.pub(b"skc.hb.1", b'{"server": 1e999}')
                            + nats.pub(b"skc.hb.7", b'{"server": 1e999, "boot": "x"}')
                            + nats.pub(b"skc.hb", b'{"server": 1e999}'))
                        # Skan-Run poison: a session past 2**64 (refused), and one
                        # just below 2**63 that B accepts (a raw client on an open
                        # NATS may speak for broker 1) but that must not make
                        # broker 1's later runs look old.
                        poison = frame("0_1@attacker/1", msg=b"poison")
                        await attacker.send(
                            run(b"sk.1.g.i._", 1, 10**19, [poison])
                            + run(b"sk.1.g.i._", 1, 2**63 - 10, [poison], first=1))
                        # Forged senders: a frame of broker 2's lname on broker 1's
                        # subject; an origin that is not the subject's broker.
                        await attacker.send(
                            run(b"sk.1.g.i._", 1, 5, [frame("0_1@host/2", msg=b"forged-1")])
                            + run(b"sk.1.g.i._", 2, 5, [frame("0_1@host/2", msg=b"forged-2")])
                            + run(b"sk.1.g.i._", 1, 6, [frame("0_1@host/1x", msg=b"forged-3")]))
                        # 50 forged heartbeats (new server ids, well-formed).
                        await attacker.send(b"".join(
                            nats.pub(b"skc.hb.%d" % i,
                                     b'{"server": %d, "boot": "00000000000000%02x"}' % (i, i))
                            for i in range(100, 150)))
                        # 2,000 hellos.
                        hello_started = time.monotonic()
                        await attacker.send(hellos)
                        await attacker.flush()
                        hello_window = time.monotonic() - hello_started
                        # 300,000 groups announced at once (over the bound: that
                        # broker counts as wanting everything), 90,000 within it,
                        # then 1,000 deltas each.
                        await attacker.send(big + fine)
                        await until_stat(watch_b, "interest_refused", 1)
                        for i in range(0, 1000, 100):
                            await attacker.send(b"".join(deltas[i:i + 100]))
                            await trio.sleep(0.01)
                        # A 10 MiB frame, over max_frame (8 MiB).
                        await attacker.send(huge)
                        # The seeded fuzz of every subject.
                        for i in range(0, len(batch), 50):
                            await attacker.send(b"".join(batch[i:i + 50]))
                            await trio.sleep(0.005)
                        await attacker.flush(timeout=30)
                        await trio.sleep(1.0)  # what NATS holds reaches the brokers
                    await by_a.settle()
                    await by_b.settle()
                figures = [by_a.figures(), by_b.figures()]
                full_sets = [m for m in attacker.msgs if m.subject in (b"skc.int.1", b"skc.int.2")
                             and (b" full " in m.payload or b" hello " in m.payload)]
                # Broker 1 is not silenced: its client's next messages all reach B.
                for i in range(5):
                    await pub.send("g", f"after-{i}")
                await receive_texts(sub, {f"after-{i}".encode() for i in range(5)})
                after_b = await cluster_stats(watch_b)
                after_a = await cluster_stats(watch_a)
                samples = await metric_samples(b.addr["metrics"])
                # 50 forged heartbeats: not seen (never proved alive), and an
                # Eventer query does not wait for them.
                assert after_a["brokers_seen"] == after_b["brokers_seen"] == "2"
                async with EventerClient.connect(*a.addr["eventer"], "t") as ev:
                    started = time.monotonic()
                    await ev.query(w.QueryLatestParams())
                    query_s = time.monotonic() - started
                await attacker.aclose()
    print("bystanders:", [f.line() for f in figures], f"query={query_s * 1000:.1f}ms",
          f"full sets sent during {hello_window:.2f}s of hellos and after: {len(full_sets)}",
          f"load factor {load_factor():.1f}")
    for f in figures:
        assert f.lost == 0, f.line()
        assert f.largest_gap_ms < STALL_MS * load_factor(), f.line()
    assert query_s < 1.0 * load_factor()
    # Counted: the forged runs, the oversized frame, the malformed messages.
    assert int(after_b["forged"]) - int(before_b["forged"]) >= 3
    assert int(after_b["oversized_in"]) == 1
    assert sample(samples, "skan_backplane_forged_total") == int(after_b["forged"])
    assert int(after_b["malformed"]) > int(before_b["malformed"])
    assert int(after_b["interest_refused"]) >= 1
    assert int(after_b["hellos_deferred"]) > 0
    # 2,000 hellos got a bounded number of full sets (one per HELLO_INTERVAL
    # at most, plus one per heartbeat), not one each.
    assert len(full_sets) < 400, len(full_sets)
    for broker in (a, b):
        assert broker.proc is not None and broker.proc.returncode == 0  # a clean stop
        assert tracebacks(broker.stderr_lines) == []
    assert HELLO_INTERVAL > 0


USERS = """[auth]
allow_anonymous = false
[[users]]
name = "alice"
token = "alice-token"
publish = ["*"]
subscribe = ["*"]
[[users]]
name = "spy"
token = "spy-token"
publish = ["public"]
subscribe = ["public"]
"""


async def forged_query(attacker: RawNats, claim: bytes, n: int) -> list[tuple[int, cq.Gathered]]:
    """Publish a query as broker 1 would (claim ``claim``); the answers that come."""
    inbox = b"_INBOX.atk.%d" % n
    attacker.msgs.clear()
    await attacker.send(nats.sub(inbox, b"q%d" % n) + nats.pub(
        b"skc.query.1", cq.encode_request(w.QueryTimeseriesParams(), claim), inbox))
    await attacker.collect(1.0)
    return [cq.decode_answer(m.payload) for m in attacker.msgs if m.subject == inbox]


async def test_forged_directed_sends_and_queries_get_only_what_the_named_user_may():
    with NatsCluster(1) as cluster:
        url = cluster.nodes[0].url
        with cluster_broker(1, url, extra=USERS) as a, cluster_broker(2, url, extra=USERS) as b:
            async with SkanClient.connect(*b.skan, token="alice-token") as alice, \
                    SkanClient.connect(*a.skan, token="alice-token") as alice_a:
                await alice.subscribe("secret")  # (a directed send needs a subscription)
                await wait_cluster(alice, 2, known=True, timeout=20)
                await wait_cluster(alice_a, 2, known=True, timeout=20)
                # Events retained by broker 2: one in "secret", one in "public".
                async with EventerClient.connect(*b.addr["eventer"], "alice",
                                                 token="alice-token") as ev:
                    await ev.register([w.RegisterEvent(("secret", "x")),
                                       w.RegisterEvent(("public", "y"))])
                attacker = await RawNats.open(url)
                before = await cluster_stats(alice)
                # A directed send "from spy" into "secret", to alice's lname,
                # as if from a client of broker 1: refused by broker 2 (spy may
                # not send to "secret" there), counted.
                target = alice.lname
                spy_frame = frame("0_1@h/1", "secret", "x", to=target, msg=b"from-spy")
                await attacker.send(run(b"sk.1.secret.x.b2", 1, 11, [spy_frame], b"spy"))
                await until_stat(alice, "refused", int(before["refused"]) + 1)
                # The same frame claiming alice is delivered: the claim is what
                # broker 2 checks (NATS permissions decide who may claim).
                ok = frame("0_1@h/1", "secret", "x", to=target, msg=b"as-alice")
                await attacker.send(run(b"sk.1.secret.x.b2", 1, 12, [ok], b"alice"))
                seen = []
                with trio.fail_after(5):
                    while b"as-alice" not in seen:
                        seen.append((await alice.receive()).msg)
                assert b"from-spy" not in seen
                samples = await metric_samples(b.addr["metrics"])
                assert sample(samples, "skan_permission_denied_total", protocol="cluster",
                              action="publish") >= 1

                # Forged queries: naming spy, only "public" comes back; with no
                # user, or claiming full rights, nothing (anonymous is refused
                # here), counted.
                # Naming alice (what a raw client on an open NATS can do: the
                # per-broker NATS permissions are what stop it): both, once
                # broker 2's store has them.
                with trio.fail_after(10):
                    for n in range(100, 1000):
                        answers = await forged_query(attacker, b"alice", n)
                        if sum(len(g.entries) for _, g in answers) == 2:
                            break
                answers = await forged_query(attacker, b"spy", 1)
                groups = {e[cq.GROUP] for _, g in answers for e in g.entries}
                assert answers and groups == {b"public"}, answers
                refused_before = int((await cluster_stats(alice))["queries_refused"])
                for n, claim in ((2, b"~"), (3, b"*")):
                    answers = await forged_query(attacker, claim, n)
                    assert answers and all(not g.entries for _, g in answers), answers
                assert int((await cluster_stats(alice))["queries_refused"]) >= refused_before + 2
                # Through the brokers: spy on broker 1 asks, broker 2 answers for spy.
                async with EventerClient.connect(*a.addr["eventer"], "spy",
                                                 token="spy-token") as spy:
                    result = await spy.query(w.QueryTimeseriesParams())
                    assert {e.type[0] for e in result.events} == {"public"}
                async with EventerClient.connect(*a.addr["eventer"], "alice",
                                                 token="alice-token") as al:
                    result = await al.query(w.QueryTimeseriesParams())
                    assert {e.type[0] for e in result.events} == {"public", "secret"}
                await attacker.aclose()
    for broker in (a, b):
        assert tracebacks(broker.stderr_lines) == []
