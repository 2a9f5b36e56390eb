"""deploy/: the container and systemd files refer to things that exist and a valid config."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess

import pytest

from broker.serving import config as cfgmod
from tests.brokerproc import ROOT
from tests.clients.scripts import run

DEPLOY = ROOT / "deploy"


def test_container_config_is_valid():
    result = run("skan-broker", "--check-config", str(DEPLOY / "broker.container.toml"))
    assert result.returncode == 0, result.stderr
    cfg = cfgmod.load(str(DEPLOY / "broker.container.toml"))
    assert cfg.broker.host == "0.0.0.0" and cfg.log.dir.startswith("/var/lib/skan")


def test_dockerfile_copies_what_exists_and_exposes_the_default_ports():
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?!--)(\S+)", text, re.M):
        assert (ROOT / src).exists(), src
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    defaults = {cfgmod.SkanSection().port, cfgmod.HSPSection().port,
                cfgmod.EventerSection().port, cfgmod.MarinerSection().port,
                cfgmod.MetricsSection().port}
    assert exposed == defaults
    assert "STOPSIGNAL SIGTERM" in text


def test_systemd_unit_checks_config_and_stops_gracefully():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keys are case-sensitive
    unit.read(DEPLOY / "skan-broker.service")
    service = unit["Service"]
    assert "--check-config" in service["ExecStartPre"]
    assert "--config" in service["ExecStart"]
    assert service["KillSignal"] == "SIGTERM"
    assert service["RestartPreventExitStatus"] == "2"  # exit 2 = bad configuration
    assert int(service["TimeoutStopSec"]) > cfgmod.BrokerSection().drain_timeout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_unit_parses():
    proc = subprocess.run(["systemd-analyze", "verify", str(DEPLOY / "skan-broker.service")],
                          capture_output=True, text=True, timeout=60)
    # The only complaint allowed is the executable not being installed on this machine.
    problems = [line for line in proc.stderr.splitlines()
                if line.strip() and "is not executable" not in line]
    assert not problems, proc.stderr
