"""The backplane towards a NATS that requires credentials or TLS (a real nats-server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.cluster.natsproc import NatsCluster, send_until_received
from tests.cluster.test_brokers import ROOT
from tests.tlsfiles import server_cert


def broker(server_id: int, url: str, cluster: str = "") -> BrokerProcess:
    return BrokerProcess(
        f"[broker]\nserver_id = {server_id}\n[cluster]\nurl = [\"{url}\"]\n"
        f"backoff_initial = 0.05\nbackoff_max = 0.5\nid_probe_timeout = 0.3\n"
        f"heartbeat = 0.2\n{cluster}")


async def crosses(a: BrokerProcess, b: BrokerProcess) -> None:
    """A message published on a reaches a subscriber on b (through NATS)."""
    async with SkanClient.connect(*a.skan) as pub, SkanClient.connect(*b.skan) as sub:
        await sub.subscribe("sec")
        await send_until_received(pub, sub, "sec", "over-nats", timeout=10, poll=0.3)


@pytest.mark.trio
async def test_user_and_password():
    with NatsCluster(1, ("--user", "skan", "--pass", "s3cret-pw")) as nats:
        url = nats.nodes[0].url
        creds = 'user = "skan"\npassword = "s3cret-pw"\n'
        with broker(1, url, creds) as a, broker(2, url, creds) as b:
            await crosses(a, b)
        wrong = broker(3, url, 'user = "skan"\npassword = "wrong"\n')
        with pytest.raises(RuntimeError) as exc:
            wrong.start()
        text = str(exc.value) + "".join(wrong.stderr_lines)
        assert "Authorization Violation" in text and "wrong" not in text.replace(
            "wrong.", "")  # the password never reaches the log
        assert "Traceback" not in text


@pytest.mark.trio
async def test_token():
    with NatsCluster(1, ("--auth", "tok-123456")) as nats:
        url = nats.nodes[0].url
        with broker(1, url, 'token = "tok-123456"\n') as a, \
                broker(2, url, 'token = "tok-123456"\n') as b:
            await crosses(a, b)


@pytest.mark.trio
async def test_tls_verified_against_the_configured_ca(tmp_path):
    cert = server_cert(tmp_path, "server")
    args = ("--tls", "--tlscert", str(cert.pem), "--tlskey", str(cert.key))
    with NatsCluster(1, args) as nats:
        url = nats.nodes[0].url.replace("nats://", "tls://")
        tls = f'tls_ca = "{cert.ca_pem}"\n'
        with broker(1, url, tls) as a, broker(2, url, tls) as b:
            await crosses(a, b)
        # Not signed by a CA the broker trusts: refused, said plainly.
        other = broker(3, url)
        with pytest.raises(RuntimeError) as exc:
            other.start()
        text = str(exc.value) + "".join(other.stderr_lines)
        assert "TLS handshake failed" in text and "CERTIFICATE_VERIFY_FAILED" in text
        assert "Traceback" not in text


@pytest.mark.parametrize("cluster, where", [
    ('url = "nats://skan:pw@127.0.0.1:4222"\n', "cluster.url[0]"),
    ('url = "nats://127.0.0.1:4222"\ntoken = "t"\nuser = "u"\npassword = "p"\n',
     "cluster.token"),
    ('url = "nats://127.0.0.1:4222"\nuser = "u"\n', "cluster.user"),
])
def test_credential_settings_checked_at_start(tmp_path, cluster, where):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cluster]\n" + cluster)
    proc = subprocess.run([sys.executable, "-m", "broker", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=30,
                          env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert where in proc.stderr and "Traceback" not in proc.stderr
    assert "pw@" not in proc.stderr  # a secret in the URL is not echoed
