"""Every command-line tool, run as the real console script: exit codes, one-line errors.

No tool may print a Python traceback for a user error, a peer error or
Ctrl-C; input is checked before anything connects; a port speaking another
protocol is reported within seconds.
"""

from __future__ import annotations

import re
import signal
import socket

import pytest

from tests.brokerproc import BrokerProcess
from tests.clients.scripts import Running, run

TOOLS = ["skan", "skan-eventer", "skan-mariner", "skan-broker", "skan-analytics"]
# "Within a few seconds": the clients' first-answer timeout is 5 s.
WRONG_PORT_SECONDS = 9.0


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tool", TOOLS)
def test_version(tool):
    result = run(tool, "--version")
    assert result.returncode == 0
    assert re.fullmatch(rf"{tool} \d+\.\d+\S*", result.stdout.strip()), result.stdout


@pytest.mark.parametrize(("tool", "args", "defaults"), [
    ("skan", [], ["(default: 127.0.0.1)", "(default: 9912, or 9913", "(default: 5.0)"]),
    ("skan", ["sub"], ["(default: *)", "(default: normal)", "decimal strings"]),
    ("skan", ["reply"], ["--text", "--echo", "(default: 0)"]),
    ("skan", ["request"], ["(default: 5.0)"]),
    ("skan-eventer", [], ["(default: 23012)", "(default: skan-eventer-cli)"]),
    ("skan-eventer", ["query"], ["(default: descending)", "(default: 1)"]),
    ("skan-mariner", [], ["(default: 23014)", "(default: skan-mariner-cli)"]),
    ("skan-broker", [], ["(default: 9912;", "(default: 23014;", "(default: 127.0.0.1)",
                         "(default: var/routing-log)", "info)", "text)", "--check-config"]),
    ("skan-analytics", ["report"], ["(default: var/routing-log)", "(default: skan-report)"]),
    ("skan-analytics", ["stream"], ["(default: 1 minute)", "(default: 30 seconds)"]),
])
def test_help_shows_defaults(tool, args, defaults):
    result = run(tool, *args, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    for needle in defaults:
        assert needle in text, (needle, result.stdout)


@pytest.mark.parametrize(("tool", "args", "needle"), [
    ("skan", ["pub", "chat", "{bad", "--json"], "bad JSON"),
    ("skan", ["request", "svc", "[1,", "--json"], "bad JSON"),
    ("skan", ["reply", "svc", "--text", "{", "--json"], "bad JSON"),
    ("skan", ["--port", "99999", "stats"], "not a TCP port"),
    ("skan", ["sub", "g", "--count", "-1"], "must not be negative"),
    ("skan", ["pub", "g", "x", "--acked"], "--acked needs --protocol hsp"),
    ("skan-eventer", ["register", "a/b", "--json", "{bad"], "bad JSON"),
    ("skan-eventer", ["register", "a/b", "--binary", "zz:nothex"], "bad hex"),
    ("skan-eventer", ["register", "a/b", "--binary", "nocolon"], "TYPE:HEX"),
    ("skan-eventer", ["query", "timeseries", "--last-event-id", "1,2"], "bad event id"),
    ("skan-mariner", ["--last-event-id", "1,2", "a/*"], "bad event id"),
    ("skan-mariner", ["--last-event-id", "a,b,c", "a/*"], "bad event id"),
    ("skan-broker", ["--log-level", "verbose"], "invalid choice: 'verbose'"),
    ("skan-broker", ["--skan-port", "x"], "not an integer"),
    ("skan-analytics", ["report", "--conf", "nokey"], "expected key=value"),
])
def test_bad_input_is_one_line_exit_2_before_connecting(tool, args, needle):
    # Nothing listens on the port: the input error must win over "cannot connect".
    port = [] if tool in ("skan-broker", "skan-analytics") or "--port" in args else [
        "--port", str(closed_port())]
    result = run(tool, *port, *args)
    assert result.returncode == 2, result.stderr
    line = result.one_line_error()
    assert line.startswith(f"{tool}") and needle in line, line


@pytest.mark.parametrize(("tool", "args"), [
    ("skan", ["stats"]),
    ("skan", ["--protocol", "hsp", "stats"]),
    ("skan-eventer", ["query", "latest"]),
    ("skan-mariner", ["a/*"]),
])
def test_nothing_listening_is_one_line(tool, args):
    port = closed_port()
    result = run(tool, "--port", str(port), *args)
    assert result.returncode == 1
    line = result.one_line_error()
    assert f"cannot connect to 127.0.0.1:{port}" in line and "connection refused" in line


@pytest.fixture(scope="module")
def broker():
    with BrokerProcess() as proc:
        yield proc


@pytest.mark.parametrize(("tool", "args", "listener", "needle"), [
    ("skan", ["stats"], "metrics", "is not a Skan broker: it answers HTTP"),
    ("skan", ["stats"], "eventer", "is not a Skan broker"),
    ("skan", ["stats"], "hsp", "is the broker's HSP port"),
    ("skan", ["stats"], "mariner", "is not a Skan broker"),
    ("skan", ["--protocol", "hsp", "stats"], "skan", "is not a Skan broker"),
    ("skan", ["--protocol", "hsp", "stats"], "eventer", "is not a Skan broker"),
    ("skan", ["--protocol", "hsp", "stats"], "metrics",
     "is not a Skan broker: it answers HTTP, not HSP"),
    ("skan-eventer", ["query", "latest"], "skan", "is not an Eventer server"),
    ("skan-eventer", ["query", "latest"], "hsp", "is not an Eventer server"),
    ("skan-eventer", ["query", "latest"], "mariner", "is not an Eventer server"),
    ("skan-eventer", ["query", "latest"], "metrics", "is not an Eventer server"),
    ("skan-mariner", ["a/*"], "eventer", "is not a Mariner server"),
    ("skan-mariner", ["a/*"], "skan", "is not a Mariner server"),
    ("skan-mariner", ["a/*"], "hsp", "is not a Mariner server"),
    ("skan-mariner", ["a/*"], "metrics", "is not a Mariner server"),
])
def test_wrong_protocol_is_reported_quickly(broker, tool, args, listener, needle):
    host, port = broker.addr[listener]
    result = run(tool, "--port", str(port), *args)
    assert result.returncode == 1
    line = result.one_line_error()
    assert f"{host}:{port} {needle}" in line, line
    assert len(line) < 300, line  # no 200-digit lengths
    assert result.seconds < WRONG_PORT_SECONDS


@pytest.mark.parametrize(("tool", "args", "ready"), [
    ("skan", ["sub", "x"], "subscribed"),
    ("skan", ["--protocol", "hsp", "sub", "x"], "subscribed"),
    ("skan", ["reply", "x"], "replying"),
    ("skan-eventer", ["subscribe", "x/*"], "subscribed"),
    ("skan-mariner", ["x/*"], "subscribed"),
])
def test_ctrl_c_exits_130_without_traceback(broker, tool, args, ready):
    listener = {"skan": "skan", "skan-eventer": "eventer", "skan-mariner": "mariner"}[tool]
    if "hsp" in args:
        listener = "hsp"
    proc = Running(tool, "--port", str(broker.addr[listener][1]), *args)
    proc.wait_stderr(ready)
    result = proc.stop(signal.SIGINT)
    assert result.returncode == 130, result.stderr
    result.assert_clean()


def test_request_timeout_is_one_line(broker):
    result = run("skan", "--port", str(broker.skan[1]), "request", "nobody-answers", "q",
                 "--timeout", "0.5")
    assert result.returncode == 1
    line = result.one_line_error()
    assert "no reply within 0.5s" in line and "is a `skan reply nobody-answers` running?" in line


def test_request_to_an_unknown_lname_says_so(broker):
    responder = Running("skan", "--port", str(broker.skan[1]), "reply", "svc")
    try:
        lname = responder.wait_stderr("replying to requests").rsplit(" as ", 1)[1].strip()
        port = str(broker.skan[1])
        result = run("skan", "--port", port, "request", "svc", "q", "--to", "nosuch@host",
                     "--timeout", "0.5")
        assert result.returncode == 1
        line = result.one_line_error()
        # A responder runs: the message must not suggest starting one.
        assert "skan reply svc` running" not in line
        assert "no connection has the lname nosuch@host and subscribes to svc" in line
        # The right lname answers.
        result = run("skan", "--port", port, "request", "svc", "q", "--to", lname,
                     "--timeout", "5")
        assert result.returncode == 0 and "repl=1" in result.stdout, result.stderr
        # A subscriber that gets the request but does not answer is told apart.
        listener = Running("skan", "--port", port, "sub", "svc")
        try:
            banner = listener.wait_stderr("subscribed to svc/*")
            silent = re.search(r" as (\S+)", banner).group(1)
            result = run("skan", "--port", port, "request", "svc", "q", "--to", silent,
                         "--timeout", "0.5")
            assert result.returncode == 1
            assert f"{silent} received it and did not answer" in result.one_line_error()
        finally:
            listener.stop(signal.SIGINT)
    finally:
        responder.stop(signal.SIGINT)


@pytest.mark.parametrize(("tool", "args", "listener"), [
    ("skan", ["sub", "x"], "skan"),
    ("skan-eventer", ["subscribe", "x/*"], "eventer"),
    ("skan-mariner", ["x/*"], "mariner"),
])
def test_broker_going_away_is_one_line_exit_1(tool, args, listener):
    with BrokerProcess() as b:
        proc = Running(tool, "--port", str(b.addr[listener][1]), *args)
        proc.wait_stderr("subscribed")
        assert b.stop() == 0
        result = proc.wait()
    assert result.returncode == 1, result.stderr
    line = result.one_line_error()
    assert str(b.addr[listener][1]) in line or "closed" in line, line


def test_sub_shows_text_as_text_and_numbers_as_strings(broker):
    port = str(broker.skan[1])
    sub = Running("skan", "--port", port, "sub", "show", "--count", "3")
    sub.wait_stderr("subscribed")
    assert run("skan", "--port", port, "pub", "show", "héllo wörld").returncode == 0
    assert run("skan", "--port", port, "pub", "show", '{"n": 1, "ok": true, "x": 1.5}',
               "--json").returncode == 0
    assert run("skan", "--port", port, "pub", "show").returncode == 0  # NULL
    result = sub.wait()
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": héllo wörld") and "b'" not in lines[0]
    assert lines[1].endswith(': {"n": "1", "ok": "true", "x": "1.5"}')
    assert lines[2].endswith(": null")
    assert result.returncode == 0


def test_reply_echo_and_count(broker):
    port = str(broker.skan[1])
    responder = Running("skan", "--port", port, "reply", "echo-svc", "--echo", "--count", "2")
    lname = responder.wait_stderr("replying").rsplit(" as ", 1)[1].strip()
    first = run("skan", "--port", port, "request", "echo-svc", '{"a": [1, 2]}', "--json")
    assert first.returncode == 0 and '"msg": {"a": ["1", "2"]}' in first.stdout
    second = run("skan", "--port", port, "request", "echo-svc", "direct", "--to", lname)
    assert second.returncode == 0 and second.stdout.strip().endswith("repl=1: direct")
    done = responder.wait()
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2
    done.assert_clean()
