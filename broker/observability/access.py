"""Who may read the metrics listener: bearer token, basic auth, loopback (pure).

The rules (docs/metrics.md "Protection", docs/security.md):

- With a credential configured in ``[metrics]`` (``token``/``token_sha256``
  for ``Authorization: Bearer``, ``username`` plus ``password``/
  ``password_sha256`` for ``Authorization: Basic``), every path but
  ``/healthz`` needs one of them; a request without, or with a wrong one,
  gets 401 with ``WWW-Authenticate`` naming the schemes configured.
- Without any, ``/metrics`` is open as it always was, and the connection
  listing (``/connections``, ``/subscriptions``), which names users, lnames
  and client addresses, is served only when the listener binds a loopback
  address, or requires TLS client certificates (``tls_client_auth =
  "require"``: the handshake is the credential).

Secrets are compared as SHA-256 digests with :func:`hmac.compare_digest`,
as users' tokens are (broker/core/auth.py).
"""

from __future__ import annotations

import base64
import binascii
import hmac

import attrs

from broker.core.auth import token_digest

# Realm of the WWW-Authenticate challenges (what a browser shows).
REALM = "skan-broker metrics"


def _digest(plain: str | None, hexed: str | None) -> bytes | None:
    if plain is not None:
        return token_digest(plain)
    if hexed is not None:
        return bytes.fromhex(hexed)
    return None


@attrs.frozen
class MetricsAccess:
    """The metrics listener's access rules, built from ``[metrics]`` and its bind address."""

    token: bytes | None = None  # SHA-256 of the bearer token
    username: str | None = None
    password: bytes | None = None  # SHA-256 of the password
    # tls_client_auth = "require": only clients with a verified certificate connect.
    client_certificates: bool = False
    # The listener binds only loopback addresses.
    loopback: bool = True

    @classmethod
    def from_section(cls, section: object, loopback: bool) -> MetricsAccess:
        return cls(
            token=_digest(getattr(section, "token", None), getattr(section, "token_sha256", None)),
            username=getattr(section, "username", None),
            password=_digest(getattr(section, "password", None),
                             getattr(section, "password_sha256", None)),
            client_certificates=getattr(section, "tls_client_auth", "none") == "require",
            loopback=loopback,
        )

    @property
    def has_credentials(self) -> bool:
        """A bearer token or basic-auth user is configured: requests must carry one."""
        return self.token is not None or self.username is not None

    @property
    def listing_served(self) -> bool:
        """Whether /connections and /subscriptions are served at all."""
        return self.has_credentials or self.client_certificates or self.loopback

    def listing_off_reason(self, host: str) -> str:
        return (f"the connection listing is off: the metrics listener binds {host!r}, which is "
                "not a loopback address, and [metrics] sets no token, username or required "
                "client certificate (see docs/metrics.md, Protection)")

    def allows(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header value may proceed."""
        if not self.has_credentials:
            return True
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        scheme = scheme.lower()
        value = value.strip()
        if scheme == "bearer" and self.token is not None:
            return hmac.compare_digest(token_digest(value), self.token)
        if scheme == "basic" and self.username is not None and self.password is not None:
            try:
                decoded = base64.b64decode(value, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return False
            user, sep, password = decoded.partition(":")
            if not sep:
                return False
            # Both compared, always, so the time taken does not tell which was wrong.
            user_ok = hmac.compare_digest(token_digest(user), token_digest(self.username))
            password_ok = hmac.compare_digest(token_digest(password), self.password)
            return user_ok and password_ok
        return False

    def challenge(self) -> tuple[tuple[str, str], ...]:
        """``WWW-Authenticate`` fields of a 401: one per scheme configured."""
        out = []
        if self.token is not None:
            out.append(("WWW-Authenticate", f'Bearer realm="{REALM}"'))
        if self.username is not None:
            out.append(("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'))
        return tuple(out)
