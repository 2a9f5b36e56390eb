"""The outside interfaces: skan-broker start-up, config refusal, signals, the skan command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio

from broker.serving import config as cfgmod
from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.cliproc import read_lines, start_subscriber

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_broker(*args: str, timeout: float = 20, cwd: os.PathLike | str | None = None
               ) -> subprocess.CompletedProcess:
    # Never the checkout: a broker's default directories are relative (var/...).
    return subprocess.run([sys.executable, "-m", "broker", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd if cwd is not None else "/")


@pytest.mark.parametrize(
    ("toml", "key", "reason"),
    [
        ("[broker]\nmax_frame = 'big'\n", "broker.max_frame", "must be an integer"),
        ("[broker]\nbogus = 1\n", "broker.bogus", "unknown key"),
        ("[nosuch]\nx = 1\n", "nosuch", "unknown section"),
        ("[skan]\nport = 70000\n", "skan.port", "between 0 and 65535"),
        ("[broker]\nslow_consumer = 'explode'\n", "broker.slow_consumer", "must be one of"),
        ("[broker]\nmax_frame = 100\nqueue_limit = 1000\n", "broker.queue_limit", "at least"),
        ("[[bridges]]\nprotocol = 'hsp'\ngroup = 'g'\n", "bridges[0].address", "is required"),
        ("[[bridges]]\nprotocol = 'hsp'\naddress = 'nohost'\ngroup = 'g'\n",
         "bridges[0].address", "host:port"),
        ("[[bridges]]\nprotocol = 'smtp'\naddress = 'h:1'\ngroup = 'g'\n",
         "bridges[0].protocol", "must be one of"),
    ],
)
def test_bad_config_refused_with_key_and_reason(tmp_path, toml, key, reason):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.load(str(path))
    assert info.value.key == key and reason in info.value.reason
    proc = run_broker("--config", str(path), "--skan-port", "0")
    assert proc.returncode == 2
    # The start-up error names the file, as --check-config does.
    assert f"skan-broker: {path}: config key {key!r}: " in proc.stderr
    assert reason in proc.stderr


def test_invalid_toml_is_reported_as_the_files_toml_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[broker]\nmax_frame = 1\nthis is not toml\n")
    for args in (["--config", str(path)], ["--check-config", str(path)]):
        proc = run_broker(*args)
        assert proc.returncode == 2
        line = proc.stderr.strip()
        assert line.startswith(f"skan-broker: {path}: not valid TOML: "), line
        assert "(at line 3, column 6)" in line and "config key" not in line, line


def test_every_wrong_key_is_reported_at_once(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[broker]\nbogus = 1\nmax_frame = 'big'\nlog_level = 'loud'\n"
                    "[skan]\nport = 70000\n[nosuch]\nx = 1\n[[users]]\ncolour = 'red'\n")
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.load(str(path))
    keys = [e.key for e in info.value.errors]
    assert keys == ["broker.bogus", "broker.max_frame", "broker.log_level", "skan.port",
                    "nosuch", "users[0].colour", "users[0].name"]
    for args in (["--config", str(path)], ["--check-config", str(path)]):
        proc = run_broker(*args)
        assert proc.returncode == 2
        lines = proc.stderr.splitlines()
        assert lines[0] == f"skan-broker: {path}: 7 configuration errors:"
        assert [line.split("'")[1] for line in lines[1:]] == keys


@pytest.mark.parametrize("level", ["DEBUG", "Info", "warning", "ERROR", "CRITICAL"])
def test_log_level_takes_pythons_names_in_any_case(tmp_path, level):
    path = tmp_path / "c.toml"
    path.write_text(f"[broker]\nlog_level = {level!r}\n")
    assert cfgmod.load(str(path)).broker.log_level == level.lower()
    proc = run_broker("--check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(cfgmod.ConfigError, match="must be one of"):
        cfgmod.from_mapping({"broker": {"log_level": "LOUD"}})


def test_an_upper_case_log_level_from_the_file_applies():
    with BrokerProcess('[broker]\nlog_level = "DEBUG"\n') as b:
        pass
    assert any(" INFO " in line for line in b.stderr_lines), b.stderr_lines[:20]
    with BrokerProcess('[broker]\nlog_level = "WARNING"\n') as b:
        pass
    assert not any(" INFO " in line for line in b.stderr_lines), b.stderr_lines[:20]


def test_help_names_every_form_of_the_command():
    proc = run_broker("--help")
    assert proc.returncode == 0
    usage = proc.stdout.split("\n\n")[0]
    assert "skan-broker hash-token" in usage and "--check-config FILE" in usage


def test_flags_override_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[broker]\nhost = '0.0.0.0'\nserver_id = 3\n[skan]\nport = 1234\n")
    cfg = cfgmod.override(cfgmod.load(str(path)), host="127.0.0.1", skan_port=0,
                          server_id=None, log_dir="/tmp/x")
    assert (cfg.broker.host, cfg.skan.port, cfg.broker.server_id, cfg.log.dir) == (
        "127.0.0.1", 0, 3, "/tmp/x")
    with pytest.raises(cfgmod.ConfigError, match="--skan-port"):
        cfgmod.override(cfg, skan_port=99999)


def test_example_config_loads():
    cfg = cfgmod.load(str(ROOT / "docs" / "broker.example.toml"))
    assert cfg.skan.port == 9912 and cfg.broker.slow_consumer == "disconnect"


def test_missing_config_file_refused():
    proc = run_broker("--config", "/nonexistent/broker.toml")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("skan-broker: cannot read /nonexistent/broker.toml: "
                                   "No such file or directory")


@pytest.mark.parametrize("busy", ["skan", "metrics"])
def test_port_in_use_is_a_clear_error_and_leaves_nothing_behind(tmp_path, busy):
    with BrokerProcess() as b:
        ports = {name: "0" for name in ("skan", "hsp", "eventer", "mariner", "metrics")}
        ports[busy] = str(b.addr[busy][1])
        flags = [arg for name, port in ports.items() for arg in (f"--{name}-port", port)]
        # The default directories (var/routing-log, var/store) are relative to
        # the working directory: the broker must not create them when it
        # cannot listen.
        proc = run_broker(*flags, cwd=tmp_path)
        assert proc.returncode == 1
        assert f"cannot start {busy} listener on 127.0.0.1:{ports[busy]}" in proc.stderr
        assert "address already in use" in proc.stderr
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_listening_lines_and_graceful_stop(sig):
    b = BrokerProcess().start()
    try:
        assert "skan" in b.addr and b.addr["skan"][1] != 0
        async with SkanClient.connect(*b.skan) as sub, SkanClient.connect(*b.skan) as pub:
            await sub.subscribe("bye")
            for i in range(200):
                await pub.send("bye", str(i))
            await pub.barrier()
            # Everything routed before the signal is delivered before the close.
            assert b.stop(sig) == 0
            got = [m.msg async for m in sub]
        assert got == [str(i).encode() for i in range(200)]
    finally:
        b.stop()


def test_the_listening_lines_come_in_one_write_even_unbuffered(tmp_path):
    # A supervisor knows the list is whole when a read ends a line
    # (broker/app/listening.py); python -u once wrote it line by line.
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "broker", "--skan-port", "0", "--hsp-port", "0",
         "--eventer-port", "0", "--mariner-port", "0", "--metrics-port", "0",
         "--log-dir", str(tmp_path / "log"), "--store-dir", str(tmp_path / "store")],
        env={**ENV, "PYTHONUNBUFFERED": "1"}, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        first = os.read(proc.stdout.fileno(), 65536).decode()
        protocols = [line.split()[1] for line in first.splitlines()]
        assert sorted(protocols) == ["eventer", "hsp", "mariner", "metrics", "skan"], first
        assert first.endswith("\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


async def test_skan_command_pub_sub_stats(broker):
    host, port = broker.skan
    base = [sys.executable, "-m", "clients.cli", "--host", host, "--port", str(port)]
    sub = await start_subscriber([*base, "sub", "cli", "--count", "2"], ENV)
    pub = await trio.run_process([*base, "pub", "cli", "hello"], env=ENV, capture_stdout=True)
    assert pub.returncode == 0
    pub = await trio.run_process([*base, "pub", "cli", '{"n": [1, null]}', "--json"], env=ENV)
    lines = await read_lines(sub, 2)
    assert lines[0].startswith("[cli/*]") and lines[0].endswith(": hello")
    assert lines[1].endswith(': {"n": ["1", null]}')
    stats = await trio.run_process([*base, "stats"], env=ENV, capture_stdout=True)
    text = stats.stdout.decode()
    assert "messages_in" in text and "subscriptions" in text


async def test_skan_command_refused_send_exits_nonzero(broker):
    host, port = broker.skan
    proc = await trio.run_process(
        [sys.executable, "-m", "clients.cli", "--host", host, "--port", str(port), "pub", "g",
         "{not json", "--json"], env=ENV, check=False, capture_stderr=True,
    )
    assert proc.returncode == 2 and b"bad JSON" in proc.stderr
