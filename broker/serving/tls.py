"""TLS for listeners and outgoing connections (BROKER-SPEC section 7).

Server contexts (optionally verifying client certificates against a CA),
client contexts for bridges and the NATS backplane, the listener whose
context a reload replaces, and the up-front handshake that names a
connection's user from its certificate.
"""

from __future__ import annotations

import logging
import ssl

import trio

from broker.core.queue import QueuedEndpoint
from broker.core.reasons import CloseReason, ErrorKind
from broker.core.router import Router

log = logging.getLogger(__name__)

# Seconds a client has to complete the TLS handshake before it is closed,
# when the listener has no handshake_timeout of its own.
TLS_HANDSHAKE_TIMEOUT = 10.0

_VERIFY_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                 "require": ssl.CERT_REQUIRED}


def server_ssl_context(
    cert: str, key: str, ca: str | None = None, client_auth: str = "none"
) -> ssl.SSLContext:
    """A listener's TLS context; with ``ca``, client certificates it signs are
    asked for ("optional") or required ("require")."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if ca is not None:
        ctx.load_verify_locations(ca)
    ctx.verify_mode = _VERIFY_MODES[client_auth]
    return ctx


def client_ssl_context(ca: str | None = None, cert: str | None = None,
                       key: str | None = None) -> ssl.SSLContext:
    """The TLS context of an outgoing connection (bridges, the NATS backplane):
    the peer verified against ``ca`` (the system CAs when None), with a client
    certificate for peers that require one."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


class TLSListener(trio.abc.Listener[trio.SSLStream]):
    """A TLS listener whose context a configuration reload may replace
    (new certificates and CAs apply to the next accepted connection)."""

    def __init__(self, transport_listener: trio.abc.Listener, context: ssl.SSLContext) -> None:
        self.transport_listener = transport_listener
        self.context = context

    async def accept(self) -> trio.SSLStream:
        stream = await self.transport_listener.accept()
        return trio.SSLStream(stream, self.context, server_side=True)

    async def aclose(self) -> None:
        await self.transport_listener.aclose()


def certificate_name(stream: trio.abc.Stream) -> str | None:
    """Subject CN of the peer's verified client certificate, or None.

    Only a certificate the handshake verified against the listener's CA is
    returned by ``getpeercert`` (it is empty otherwise).
    """
    if not isinstance(stream, trio.SSLStream):
        return None
    cert = stream.getpeercert()
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


async def tls_handshake(stream: trio.abc.Stream, ep: QueuedEndpoint, router: Router,
                        timeout: float | None = None) -> bool:
    """Complete a TLS handshake up front (so the certificate is known before
    the first message) and note the verified certificate's name on ``ep``.

    False when the handshake fails or times out (counted; a failure where a
    client certificate is required counts as an authentication failure).
    """
    if not isinstance(stream, trio.SSLStream):
        return True
    try:
        with trio.fail_after(TLS_HANDSHAKE_TIMEOUT if timeout is None else timeout):
            await stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
        if stream.context.verify_mode == ssl.CERT_REQUIRED:
            router.counters.auth_failure(ep.protocol)
        router.counters.protocol_error(ep.protocol, ErrorKind.TLS_HANDSHAKE)
        cause = exc.__cause__ or exc
        log.info("%s %s: TLS handshake failed: %s", ep.protocol, ep.lname.decode(), cause)
        ep.closing = CloseReason.TLS_HANDSHAKE
        return False
    ep.cert_name = certificate_name(stream)
    return True
