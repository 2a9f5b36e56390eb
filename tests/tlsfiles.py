"""A throw-away CA and a server certificate for 127.0.0.1/localhost, as files.

Every TLS test (listeners, metrics, bridges, the cluster's NATS link) needs
the same three files: the server's certificate chain with its key, the key
alone, and the CA that clients trust.
"""

from __future__ import annotations

import pathlib

import attrs
import trustme


@attrs.frozen
class ServerCert:
    ca: trustme.CA
    pem: pathlib.Path  # the certificate chain, with the private key first
    key: pathlib.Path  # the private key alone
    ca_pem: pathlib.Path  # the CA's certificate (what clients trust)

    def section(self, name: str) -> str:
        """A TOML section giving a listener this certificate."""
        return f'[{name}]\ntls_cert = "{self.pem}"\ntls_key = "{self.key}"\n'


def server_cert(directory: pathlib.Path, stem: str = "broker") -> ServerCert:
    """A new CA and a certificate for 127.0.0.1 and localhost, written to
    ``directory`` as ``<stem>.pem``, ``<stem>.key`` and ``ca.pem``."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    pem, key, ca_pem = directory / f"{stem}.pem", directory / f"{stem}.key", directory / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    cert.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_pem))
    return ServerCert(ca, pem, key, ca_pem)
