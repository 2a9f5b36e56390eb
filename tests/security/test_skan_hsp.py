"""Section 7 over real sockets: Skan and Skan over HSP (credentials, permissions, counters)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import trio

from clients.hsp import SkanOverHSP
from clients.skan import SkanClient, SkanClientError
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.rawhsp import RawHSP
from tests.rawskan import RawSkan
from tests.security.common import DASH_TOKEN, OP_TOKEN, SENSOR_TOKEN, USERS
from wire.hsp import Ack, Error

NOT_AUTHORISED = 4  # HSP ERROR Type


@pytest.fixture(scope="module")
def ubroker():
    with BrokerProcess(USERS) as b:
        yield b
    assert b.proc is not None and b.proc.returncode == 0, "".join(b.stderr_lines[-40:])
    # Every refusal is one log line, never a traceback.
    assert not any("Traceback" in line for line in b.stderr_lines), "".join(b.stderr_lines)


def metric(data, name: str, **labels: str) -> float:
    return data.get((name, frozenset(labels.items())), 0.0)


# ---- credentials ----------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong", ""])
async def test_skan_without_a_valid_token_is_refused_and_closed(ubroker, token):
    raw = await RawSkan.open(ubroker.skan)
    msg = {"type": "getlname", "seq": "1"}
    if token is not None:
        msg["token"] = token
    await raw.send(msg)
    got = await raw.expect_closed()
    assert len(got) == 1 and got[0][b"type"] == b"error", got
    assert got[0][b"error"].startswith(b"not authorised: ")


async def test_skan_tokens_and_hashed_tokens_authenticate(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
        SkanClient.connect(*ubroker.skan, token=DASH_TOKEN) as dash,
    ):
        # lnames carry 64 random bits: hex time, counter + 16 hex digits, host.
        for lname in (sensor.lname, dash.lname):
            assert re.fullmatch(r"[0-9a-f]+_[0-9a-f]*[0-9a-f]{16}@.+", lname), lname
        assert sensor.lname.split("@")[0][-16:] != dash.lname.split("@")[0][-16:]
        await dash.subscribe("telemetry")
        await sensor.send("telemetry", "21.5")
        assert (await dash.receive()).msg == b"21.5"


async def test_client_reports_a_refused_token(ubroker):
    with pytest.raises(SkanClientError, match="not authorised"):
        async with SkanClient.connect(*ubroker.skan, token="wrong"):
            pass


async def test_max_connections_per_user(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN),
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN),
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN),
    ):
        with pytest.raises(SkanClientError, match="max_connections"):
            async with SkanClient.connect(*ubroker.skan, token=OP_TOKEN):
                pass
    # Closed connections are given back.
    async with SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as again:
        assert again.lname


# ---- permissions ------------------------------------------------------------------------


async def test_send_outside_publish_gets_an_error_with_seq_and_stays_open(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
    ):
        await op.subscribe("commands.sensor")
        await sensor.send("commands.sensor", "forged", seq="77")
        await sensor.send("alarms.fire", "allowed", seq="78")
        await sensor.barrier()
        assert [(e.reason.startswith("not authorised: "), e.seq) for e in sensor.errors] == [
            (True, b"77")]
        assert "may not send to group 'commands.sensor'" in sensor.errors[0].reason
        assert (await sensor.stats())["uptime"] is not None  # still open
        with trio.move_on_after(0.3):
            got = await op.receive()
            raise AssertionError(f"refused send was delivered: {got}")


async def test_subscribe_outside_permissions_is_refused_and_makes_nothing(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=DASH_TOKEN) as dash,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
    ):
        before = int((await dash.stats())["subscriptions"])
        await dash.send_raw({"type": "subscribe", "group": "commands.sensor", "instance": "*",
                             "seq": "5"})
        await dash.send_raw({"type": "subscribe", "group": "telemetry", "instance": "*",
                             "subtype": "promisc", "seq": "6"})
        await dash.barrier()
        assert [e.seq for e in dash.errors] == [b"5", b"6"]
        assert "promisc" in dash.errors[1].reason
        assert int((await dash.stats())["subscriptions"]) == before
        await op.send("commands.sensor", "for the sensor only")
        with trio.move_on_after(0.3):
            raise AssertionError(f"delivered: {await dash.receive()}")


async def test_promisc_operator_sees_directed_traffic(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
        SkanClient.connect(*ubroker.skan, token=DASH_TOKEN) as dash,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
    ):
        await dash.subscribe("telemetry", subtype="meonly")
        await op.subscribe("telemetry", subtype="promisc")
        await sensor.send("telemetry", "to the dashboard", to=dash.lname)
        assert (await dash.receive()).msg == b"to the dashboard"
        assert (await op.receive()).to == dash.lname


async def test_replies_are_sends_and_need_publish(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=DASH_TOKEN) as dash,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
    ):
        await dash.subscribe("telemetry")
        await op.send("telemetry", "request", seq="9")
        request = await dash.receive()
        # The dashboard may not publish: its reply is refused like any send.
        await dash.reply(request, "answer")
        await dash.barrier()
        assert len(dash.errors) == 1 and "may not send" in dash.errors[0].reason
        with trio.move_on_after(0.3):
            raise AssertionError(f"reply delivered: {await op.receive()}")


async def test_replies_reach_only_requesters_that_may_subscribe(ubroker):
    async with (
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
        SkanClient.connect(*ubroker.skan, token=OP_TOKEN) as op,
    ):
        # A reply reaches its requester regardless of subscriptions, but only
        # in a group the requester may subscribe to: a "reply" on telemetry
        # (which the sensor may only publish to) does not reach it.
        await op.send("telemetry", "forged reply", to=sensor.lname, repl="1")
        await op.send("commands.sensor", "real reply", to=sensor.lname, repl="2")
        got = await sensor.receive()
        assert (got.group, got.msg) == ("commands.sensor", b"real reply")


# ---- Skan over HSP ------------------------------------------------------------------------


async def test_hsp_refusals(ubroker):
    raw = await RawHSP.open(ubroker.addr["hsp"])
    mid = await raw.data_ack({"type": "getlname"})
    got = await raw.expect_closed()
    assert len(got) == 1 and type(got[0]) is Error, got
    assert (got[0].message_id, got[0].type) == (mid, NOT_AUTHORISED)
    assert got[0].reason.startswith("not authorised: ")

    raw = await RawHSP.open(ubroker.addr["hsp"])
    mid = await raw.data_ack({"type": "getlname", "token": SENSOR_TOKEN})
    ack, reply = await raw.events_n(2)
    assert ack == Ack(mid) and b"lname" in RawHSP.skan(reply)
    lname = RawHSP.skan(reply)[b"lname"]
    send = {"type": "send", "group": "commands.sensor", "instance": "*", "to": "*",
            "from": lname, "seq": "3", "msg": None}
    mid = await raw.data_ack(send)
    err = await raw.event()
    assert type(err) is Error and (err.message_id, err.type) == (mid, NOT_AUTHORISED)
    # Still open: an allowed send is acknowledged.
    mid = await raw.data_ack({**send, "group": "telemetry", "seq": "4"})
    assert await raw.event() == Ack(mid)
    # A plain DATA refusal comes back as the Skan error frame with its seq.
    await raw.data({**send, "seq": "5"})
    frame = RawHSP.skan(await raw.event())
    assert frame[b"type"] == b"error" and frame[b"seq"] == b"5"
    await raw.aclose()


async def test_hsp_client_with_token(ubroker):
    async with (
        SkanOverHSP.connect(*ubroker.addr["hsp"], token=DASH_TOKEN) as dash,
        SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor,
    ):
        await dash.subscribe("alarms.smoke")
        await sensor.send("alarms.smoke", "smoke!")
        assert (await dash.receive()).msg == b"smoke!"
        await dash.send_raw({"type": "subscribe", "group": "commands.sensor", "instance": "*",
                             "seq": "8"})
        await dash.barrier()
        assert [e.seq for e in dash.errors] == [b"8"]
        assert "may not subscribe" in dash.errors[0].reason


# ---- counters --------------------------------------------------------------------------------


async def test_refusals_are_counted(ubroker):
    before = await scrape(ubroker.addr["metrics"])
    raw = await RawSkan.open(ubroker.skan)
    await raw.send({"type": "getlname", "token": "bad"})
    await raw.expect_closed()
    raw = await RawHSP.open(ubroker.addr["hsp"])
    await raw.data_ack({"type": "getlname"})
    await raw.expect_closed()
    async with SkanClient.connect(*ubroker.skan, token=SENSOR_TOKEN) as sensor:
        await sensor.send("nope", "x")
        await sensor.subscribe("nope")
    after = await scrape(ubroker.addr["metrics"])

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("skan_auth_failures_total", protocol="skan") == 1
    assert delta("skan_auth_failures_total", protocol="hsp") == 1
    assert delta("skan_permission_denied_total", protocol="skan", action="publish") == 1
    assert delta("skan_permission_denied_total", protocol="skan", action="subscribe") == 1
    # Every label value exists before its first refusal.
    assert ("skan_permission_denied_total",
            frozenset({"protocol": "mariner", "action": "subscribe"}.items())) in after


# ---- anonymous rules --------------------------------------------------------------------------


def run_broker(*args: str, config: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=30, input=config)


def test_non_loopback_without_users_refuses_to_start(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text("")
    proc = run_broker("--config", str(path), "--host", "0.0.0.0", "--skan-port", "0")
    assert proc.returncode == 2
    assert "auth.allow_anonymous" in proc.stderr and "not a loopback address" in proc.stderr
    assert "listening" not in proc.stdout


async def test_explicit_allow_anonymous_starts_on_any_address():
    with BrokerProcess("[auth]\nallow_anonymous = true\n", ("--host", "0.0.0.0")) as b:
        async with SkanClient.connect("127.0.0.1", b.skan[1]) as c:
            assert c.lname


async def test_anonymous_user_gets_its_permissions():
    config = USERS.replace("allow_anonymous = false",
                           'allow_anonymous = true\nanonymous_user = "dashboard"')
    with BrokerProcess(config) as b:
        async with (
            SkanClient.connect(*b.skan) as anon,
            SkanClient.connect(*b.skan, token=SENSOR_TOKEN) as sensor,
        ):
            await anon.subscribe("telemetry")
            await anon.send("telemetry", "anonymous may not publish", seq="3")
            await anon.barrier()
            assert [e.seq for e in anon.errors] == [b"3"]
            await sensor.send("telemetry", "ok")
            assert (await anon.receive()).msg == b"ok"


async def test_users_without_allow_anonymous_refuse_anonymous_on_loopback():
    config = USERS.replace("allow_anonymous = false\n", "")
    with BrokerProcess(config) as b:
        raw = await RawSkan.open(b.skan)
        await raw.send({"type": "getlname"})
        got = await raw.expect_closed()
        assert got[0][b"error"].startswith(b"not authorised: anonymous")
