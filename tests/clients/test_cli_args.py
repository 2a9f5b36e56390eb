"""Options and positionals in any order, in every subcommand of every client tool (issue 24
item 6), and ``skan pub --event-json`` / ``skan sub`` with the payload-json tag."""

from __future__ import annotations

import json

import pytest

from clients import cli as skan_cli
from clients import eventer_cli, mariner_cli
from tests.brokerproc import BrokerProcess
from tests.clients.scripts import Running, run


def _parse(parser, argv):
    return vars(parser.parse_args(argv))


def _subset(got: dict, want: dict) -> dict:
    return {k: got.get(k) for k in want}


# Every subcommand with options before, between and after its positionals; each
# row is (argv, what the namespace must hold).  The same namespace whatever the order.
SKAN_CASES = [
    (["pub", "g", "--instance", "i", "m"], {"group": "g", "message": "m", "instance": "i"}),
    (["pub", "--instance", "i", "g", "m"], {"group": "g", "message": "m", "instance": "i"}),
    (["pub", "g", "m", "--instance", "i"], {"group": "g", "message": "m", "instance": "i"}),
    (["pub", "g", "--to", "x_1@h", "--count", "2", "m", "--port", "7"],
     {"group": "g", "message": "m", "to": "x_1@h", "count": 2, "port": 7}),
    (["pub", "g", "--json", '{"a":"b"}'], {"group": "g", "message": {b"a": b"b"}}),
    (["sub", "--count", "3", "g", "--instance", "i", "--subtype", "promisc"],
     {"group": "g", "count": 3, "instance": "i", "subtype": "promisc"}),
    (["request", "g", "--timeout", "2", "m", "--to", "x"],
     {"group": "g", "message": "m", "timeout": 2.0, "to": "x"}),
    (["reply", "--count", "1", "g", "--instance", "i", "--text", "t"],
     {"group": "g", "count": 1, "instance": "i", "text": "t"}),
    (["stats", "--port", "7"], {"port": 7}),
    (["--port", "7", "stats"], {"port": 7}),
    (["--host", "h", "stats", "--port", "7"], {"host": "h", "port": 7}),
    # a value given before the command is kept when the command does not repeat it
    (["--port", "7", "pub", "g", "m"], {"port": 7, "group": "g", "message": "m"}),
    (["pub", "g", "m", "--protocol", "hsp", "--acked"],
     {"protocol": "hsp", "acked": True, "port": 9913}),
    (["sub", "g", "--token", "secret", "--connect-timeout", "2"],
     {"token": "secret", "connect_timeout": 2.0}),
    (["connections", "--limit", "5", "--port", "7", "--sort", "since"],
     {"limit": 5, "port": 7, "sort": "since"}),
    (["--host", "h", "subscriptions", "--group", "g", "--port", "7"],
     {"host": "h", "group": "g", "port": 7}),
]


@pytest.mark.parametrize(("argv", "want"), SKAN_CASES, ids=lambda v: " ".join(map(str, v))
                         if isinstance(v, list) else "")
def test_skan_options_mix_with_positionals(argv, want):
    got = vars(skan_cli.parse_args(argv))
    assert _subset(got, want) == want


EVENTER_CASES = [
    (["register", "a/b", "--json", "1", "--port", "5"],
     {"type": ("a", "b"), "json": 1, "port": 5}),
    (["register", "--source-timestamp", "2.5", "a/b"], {"type": ("a", "b"),
                                                        "source_timestamp": 2.5}),
    (["subscribe", "a/*", "--port", "5", "b/*"], {"patterns": [("a", "*"), ("b", "*")],
                                                  "port": 5}),
    (["query", "--max-results", "3", "latest", "--port", "5"],
     {"kind": "latest", "max_results": 3, "port": 5}),
    (["query", "timeseries", "--order", "ascending", "--types", "a/*"],
     {"kind": "timeseries", "order": "ascending", "types": [("a", "*")]}),
    (["--port", "5", "query", "server", "--server-id", "2"],
     {"port": 5, "kind": "server", "server_id": 2}),
]


@pytest.mark.parametrize(("argv", "want"), EVENTER_CASES)
def test_skan_eventer_options_mix_with_positionals(argv, want):
    assert _subset(_parse(eventer_cli.build_parser(), argv), want) == want


@pytest.mark.parametrize(("argv", "want"), [
    (["a/*", "--port", "5", "b/*"], {"patterns": [("a", "*"), ("b", "*")], "port": 5}),
    (["--client-id", "c", "a/*", "--last-event-id", "1,2,3"],
     {"patterns": [("a", "*")], "client_id": "c", "last_event_id": (1, 2, 3)}),
])
def test_skan_mariner_options_mix_with_positionals(argv, want):
    assert _subset(_parse(mariner_cli.build_parser(), argv), want) == want


def test_event_json_sends_the_view_and_the_tag():
    args = skan_cli.parse_args(["pub", "plant", "--event-json", '{"on": true, "v": 1234}',
                                "--instance", "pump1"])
    assert args.message == {b"on": b"true", b"v": b"1234"}
    assert args.tags == {"payload-json": b'{"on":true,"v":1234}'}
    # strings only: the Skan view is exact, no tag
    args = skan_cli.parse_args(["pub", "plant", "--event-json", '{"s": "x"}'])
    assert args.message == {b"s": b"x"} and not args.tags


@pytest.mark.parametrize(("argv", "needle"), [
    (["pub", "g", "--event-json", "{nope"], "not valid JSON"),
    (["pub", "g", "--event-json", "9" * 101], "digits"),
    (["pub", "g", "--event-json"], "needs the JSON text"),
    (["pub", "g", "--event-json", "--json", "1"], "not allowed with"),
])
def test_bad_event_json_is_a_usage_error(argv, needle):
    result = run("skan", *argv)
    assert result.returncode == 2
    assert needle in result.one_line_error()


@pytest.fixture(scope="module")
def broker():
    with BrokerProcess() as proc:
        yield proc


def test_pub_with_options_after_the_group_and_stats_port_against_a_broker(broker):
    port = str(broker.skan[1])
    sub = Running("skan", "sub", "mixed", "--port", port, "--count", "1", "--instance", "i")
    sub.wait_stderr("subscribed")
    assert run("skan", "pub", "mixed", "--instance", "i", "hello", "--port", port).returncode == 0
    result = sub.wait()
    assert result.returncode == 0
    line = result.stdout.strip()
    assert line.startswith("[mixed/i] ") and line.endswith(": hello"), line
    stats = run("skan", "stats", "--port", port)
    assert stats.returncode == 0 and "uptime" in stats.stdout


def test_event_json_reaches_hat_and_skan_subscribers(broker):
    skan_port, eventer_port = str(broker.skan[1]), str(broker.addr["eventer"][1])
    sub = Running("skan", "sub", "plant", "--port", skan_port, "--count", "1")
    sub.wait_stderr("subscribed")
    hat = Running("skan-eventer", "subscribe", "plant/*", "--port", eventer_port)
    hat.wait_stderr("subscribed")
    text = '{"request_id": "w", "value": 1234, "on": true, "f": 1.0, "n": null}'
    assert run("skan", "pub", "plant", "--event-json", text, "--instance", "pump1",
               "--port", skan_port).returncode == 0
    line = hat.readline()
    hat.stop()
    event = json.loads(line)
    assert event["type"] == ["plant", "pump1"]
    assert event["payload"] == {"json": json.loads(text)}
    assert isinstance(event["payload"]["json"]["f"], float)
    shown = sub.wait().stdout.strip()
    # the Skan view, then the exact JSON of the tag
    assert shown.endswith(': {"request_id": "w", "value": "1234", "on": "true", "f": "1.0", '
                          '"n": null} payload-json={"request_id":"w","value":1234,"on":true,'
                          '"f":1.0,"n":null}'), shown
