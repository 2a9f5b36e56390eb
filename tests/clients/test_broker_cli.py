"""``skan-broker`` as an operator meets it: --check-config, log settings, start-up errors.

Run as the real console script; the example configuration is checked
against the configuration classes so it cannot fall behind them.
"""

from __future__ import annotations

import json
import re
import socket
import time
import tomllib

import attrs
import pytest

from broker.serving import config as cfgmod
from tests.brokerproc import ROOT, BrokerProcess
from tests.clients.scripts import run

EXAMPLE = ROOT / "docs" / "broker.example.toml"


def _example_keys() -> dict[str, set[str]]:
    """Keys per section of the example, set or commented out (``# key = ...``)."""
    keys: dict[str, set[str]] = {}
    section = ""
    for raw in EXAMPLE.read_text().splitlines():
        line = raw.strip()
        m = re.fullmatch(r"#?\s*\[\[?([a-z_]+)\]\]?.*", line)
        if m and (not line.startswith("# ") or "[[" in line):
            section = m.group(1)
            keys.setdefault(section, set())
            continue
        m = re.fullmatch(r"#?\s*([a-z0-9_]+)\s*=.*", line)
        if m and section:
            keys[section].add(m.group(1))
    return keys


def test_example_config_names_every_key_of_every_section():
    keys = _example_keys()
    sections = {**cfgmod._SECTIONS, "bridges": cfgmod.BridgeSection,
                "users": cfgmod.UserSection}
    for name, cls in sections.items():
        assert name in keys, f"section [{name}] missing from {EXAMPLE.name}"
        missing = {f.name for f in attrs.fields(cls)} - keys[name]
        assert not missing, f"[{name}] lacks {sorted(missing)} in {EXAMPLE.name}"
        unknown = keys[name] - {f.name for f in attrs.fields(cls)}
        assert not unknown, f"[{name}] has unknown keys {sorted(unknown)}"


def test_example_config_values_are_the_defaults():
    data = tomllib.loads(EXAMPLE.read_text())
    loaded = cfgmod.from_mapping(data)
    assert loaded == cfgmod.Config(), "the example must show the defaults"


def test_check_config_valid_example():
    result = run("skan-broker", "--check-config", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    result.assert_clean()


@pytest.mark.parametrize(("toml", "needle"), [
    ("[broker]\nlog_level = 'verbose'\n", "broker.log_level"),
    ("[broker]\nlog_format = 'xml'\n", "broker.log_format"),
    ("[log]\nmax_bytes = -1\n", "log.max_bytes"),
    ("[skan]\ntls_cert = '/no/such.crt'\ntls_key = '/no/such.key'\n", "/no/such.crt"),
    ("[broker]\nmax_frame = 'big'\n", "broker.max_frame"),
    ("not toml at all", "not valid TOML"),
])
def test_check_config_invalid_names_key_and_never_listens(tmp_path, toml, needle):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    result = run("skan-broker", "--check-config", str(path))
    assert result.returncode == 2
    line = result.one_line_error()
    assert needle in line and str(path) in line, line
    assert "listening" not in result.stdout


def test_missing_tls_file_at_start_names_the_file(tmp_path):
    path = tmp_path / "tls.toml"
    path.write_text("[hsp]\ntls_cert = '/no/cert.pem'\ntls_key = '/no/key.pem'\n")
    result = run("skan-broker", "--config", str(path), "--skan-port", "0")
    assert result.returncode == 2
    line = result.one_line_error()
    assert "hsp.tls_cert" in line and "/no/cert.pem" in line


def test_port_in_use_names_listener_and_address(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run("skan-broker", "--skan-port", "0", "--hsp-port", str(port),
                     "--eventer-port", "0", "--mariner-port", "0", "--metrics-port", "0",
                     "--log-dir", str(tmp_path / "log"))
    assert result.returncode == 1
    result.assert_clean()
    line = result.stderr.splitlines()[-1]  # after the INFO lines of the services that started
    assert line == f"skan-broker: cannot start hsp listener on 127.0.0.1:{port}: " \
                   "address already in use", line


def test_log_level_and_json_format_from_config():
    with BrokerProcess("[broker]\nlog_format = 'json'\nlog_level = 'debug'\n") as b:
        pass
    records = [json.loads(line) for line in b.stderr_lines if line.strip()]
    assert records, "no diagnostics"
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["level"] == "DEBUG" for r in records) or any(
        r["level"] == "INFO" for r in records)


def test_log_level_flag_overrides_config():
    with BrokerProcess("[broker]\nlog_level = 'debug'\n", args=("--log-level", "WARNING")) as b:
        pass
    assert not any(" INFO " in line or " DEBUG " in line for line in b.stderr_lines), \
        b.stderr_lines


def test_bridge_down_is_a_warning():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again when the block ends: nothing listens
    conf = (f"[[bridges]]\nprotocol = 'hsp'\naddress = '127.0.0.1:{dead}'\ngroup = 'g'\n"
            "backoff_initial = 0.1\nbackoff_max = 0.2\n")
    with BrokerProcess(conf) as b:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                "bridge" in line and " down " in line for line in b.stderr_lines):
            time.sleep(0.05)
    down = [line for line in b.stderr_lines if "bridge" in line and " down " in line]
    assert down and all(" WARNING " in line for line in down), down
