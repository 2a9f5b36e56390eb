"""SIGHUP reload under traffic (section 7): users, permissions and tokens change live.

A feeder publishes continuously while the configuration changes: a removed
user's connection is closed, a changed token's connection is closed and the
old token no longer works, a subscription no longer permitted is removed,
and a subscriber whose permissions did not change loses nothing.  A file
that does not validate is refused with its key and reason in the log, and
the running configuration stays.
"""

from __future__ import annotations

import signal
import time

import pytest
import trio

from clients.skan import SkanClient, SkanClientError
from tests.brokerproc import BrokerProcess

BASE = """
[auth]
allow_anonymous = false

[[users]]
name = "feeder"
token = "feed"
publish = ["telemetry", "alarms.*"]

[[users]]
name = "watcher"
token = "watch"
subscribe = ["telemetry", "alarms.*"]

[[users]]
name = "dashboard"
token = "dash"
subscribe = {dash_subscribe}

[[users]]
name = "rotating"
token = "{rotating_token}"
subscribe = ["telemetry"]
{operator}
"""

OPERATOR = """
[[users]]
name = "operator"
token = "op"
subscribe = ["*"]
promisc = true
"""


def config(*, dash_subscribe='["telemetry", "alarms.*"]', rotating_token="old",
           operator=OPERATOR) -> str:
    return BASE.format(dash_subscribe=dash_subscribe, rotating_token=rotating_token,
                       operator=operator)


async def wait_log(broker: BrokerProcess, text: str, start: int, timeout: float = 10) -> str:
    with trio.fail_after(timeout):
        while True:
            for line in broker.stderr_lines[start:]:
                if text in line:
                    return line
            await trio.sleep(0.05)


async def closed(client: SkanClient, timeout: float = 5) -> bool:
    """True once the broker has closed ``client``'s connection."""
    with trio.move_on_after(timeout):
        try:
            while True:
                await client.receive()
        except trio.EndOfChannel:
            return True
    return False


async def test_reload_under_traffic():
    with BrokerProcess(config()) as b:
        async with (
            SkanClient.connect(*b.skan, token="feed") as feeder,
            SkanClient.connect(*b.skan, token="watch") as watcher,
            SkanClient.connect(*b.skan, token="dash") as dash,
            SkanClient.connect(*b.skan, token="old") as rotating,
            SkanClient.connect(*b.skan, token="op") as op,
        ):
            await watcher.subscribe("telemetry")
            await dash.subscribe("telemetry")
            await dash.subscribe("alarms.fire")
            await op.subscribe("telemetry", subtype="promisc")
            await rotating.barrier()
            sent = 0
            stop = trio.Event()

            async def feed() -> None:
                nonlocal sent
                while not stop.is_set():
                    sent += 1
                    await feeder.send("telemetry", str(sent))
                    if sent % 50 == 0:
                        await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed)
                await trio.sleep(0.3)
                # Operator removed, the rotating user's token changed, the
                # dashboard may no longer subscribe to telemetry.
                b.config_path.write_text(config(dash_subscribe='["alarms.*"]',
                                                rotating_token="new", operator=""))
                mark = len(b.stderr_lines)
                b.proc.send_signal(signal.SIGHUP)
                line = await wait_log(b, "configuration reloaded", mark)
                assert "2 connections closed" in line, line
                await trio.sleep(0.3)
                stop.set()
            await feeder.barrier()
            assert await closed(op) and await closed(rotating)
            # The dashboard stays connected, without its telemetry subscription.
            stats = await dash.stats()
            await feeder.send("telemetry", "after")
            await feeder.send("alarms.fire", "fire!")
            await feeder.barrier()
            got = []
            with trio.move_on_after(2):
                while True:
                    m = await dash.receive()
                    got.append((m.group, m.msg))
                    if m.group == "alarms.fire":
                        break
            assert got[-1] == ("alarms.fire", b"fire!")
            assert ("telemetry", b"after") not in got
            assert stats  # still answered after the reload
            # The watcher's permissions did not change: every message, in order.
            seqs = []
            with trio.fail_after(20):
                while len(seqs) < sent + 1:
                    seqs.append((await watcher.receive()).msg)
            assert seqs == [str(i).encode() for i in range(1, sent + 1)] + [b"after"]
        # The old token no longer works; the new one does; the operator is gone.
        with pytest.raises(SkanClientError, match="not authorised"):
            async with SkanClient.connect(*b.skan, token="old"):
                pass
        with pytest.raises(SkanClientError, match="not authorised"):
            async with SkanClient.connect(*b.skan, token="op"):
                pass
        async with SkanClient.connect(*b.skan, token="new") as again:
            assert again.lname


async def test_invalid_file_is_refused_and_the_running_config_stays():
    with BrokerProcess(config()) as b:
        b.config_path.write_text(config().replace('publish = ["telemetry", "alarms.*"]',
                                                  'publish = ["tele*metry"]'))
        mark = len(b.stderr_lines)
        b.proc.send_signal(signal.SIGHUP)
        line = await wait_log(b, "reload refused", mark)
        assert "users[0].publish" in line and "'*' may only be the last character" in line
        async with (
            SkanClient.connect(*b.skan, token="feed") as feeder,
            SkanClient.connect(*b.skan, token="watch") as watcher,
        ):
            await watcher.subscribe("telemetry")
            await feeder.send("telemetry", "still works")
            assert (await watcher.receive()).msg == b"still works"
        # A file that is valid TOML-wise but exposes the broker is refused too.
        b.config_path.write_text("[broker]\nhost = '0.0.0.0'\n")
        mark = len(b.stderr_lines)
        b.proc.send_signal(signal.SIGHUP)
        line = await wait_log(b, "reload refused", mark)
        assert "auth.allow_anonymous" in line
        async with SkanClient.connect(*b.skan, token="op") as op:
            assert op.lname


async def test_reload_adds_a_user_and_tls_certificates(tmp_path):
    import ssl

    import trustme

    def write_pki(ca: trustme.CA) -> None:
        cert = ca.issue_cert("127.0.0.1")
        cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "broker.pem"))
        cert.private_key_pem.write_to_path(str(tmp_path / "broker.key"))
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    old_ca, new_ca = trustme.CA(), trustme.CA()
    write_pki(old_ca)
    tls = (f'\n[skan]\ntls_cert = "{tmp_path / "broker.pem"}"\n'
           f'tls_key = "{tmp_path / "broker.key"}"\ntls_ca = "{tmp_path / "ca.pem"}"\n'
           'tls_client_auth = "optional"\n')

    def ctx(ca: trustme.CA, cn: str | None = None) -> ssl.SSLContext:
        c = ssl.create_default_context()
        ca.configure_trust(c)
        if cn:
            ca.issue_cert(f"{cn}.example", common_name=cn).configure_cert(c)
        return c

    with BrokerProcess(config() + tls) as b:
        async with SkanClient.connect(*b.skan, ssl_context=ctx(old_ca), token="feed") as c:
            assert c.lname
        write_pki(new_ca)
        b.config_path.write_text(config() + tls + '\n[[users]]\nname = "newbie"\n'
                                 'subscribe = ["telemetry"]\n')
        mark = len(b.stderr_lines)
        started = time.monotonic()
        b.proc.send_signal(signal.SIGHUP)
        await wait_log(b, "configuration reloaded", mark)
        assert time.monotonic() - started < 10
        # New server certificate and CA: clients that trust only the old CA fail,
        # a certificate of the new CA authenticates the new (certificate-only) user.
        stream = await trio.open_ssl_over_tcp_stream(*b.skan, ssl_context=ctx(old_ca))
        with pytest.raises(trio.BrokenResourceError) as info:
            await stream.do_handshake()
        assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
        await trio.aclose_forcefully(stream)
        async with SkanClient.connect(*b.skan, ssl_context=ctx(new_ca, "newbie")) as n:
            await n.subscribe("telemetry")
            assert not n.errors


async def test_withdrawing_anonymous_access_closes_anonymous_connections():
    open_config = config().replace("allow_anonymous = false", "allow_anonymous = true")
    with BrokerProcess(open_config) as b:
        async with (
            SkanClient.connect(*b.skan) as anon,
            SkanClient.connect(*b.skan, token="watch") as watcher,
        ):
            await anon.subscribe("anything")
            b.config_path.write_text(config())
            mark = len(b.stderr_lines)
            b.proc.send_signal(signal.SIGHUP)
            line = await wait_log(b, "configuration reloaded", mark)
            assert "1 connections closed" in line
            assert await closed(anon)
            assert (await watcher.stats())["uptime"] is not None
