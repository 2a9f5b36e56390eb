"""Users, credentials and permissions (BROKER-SPEC section 7).  Pure: no trio, no I/O.

- :class:`GroupPatterns` matches group names against ``name``, ``*`` or a
  prefix ending in ``*``.
- :class:`Permissions` is what a connection may do: publish to which groups,
  subscribe to which groups, promisc or not.  An endpoint whose ``perms`` is
  None has full rights (anonymous on an open broker, bridges without a user):
  the routing hot path then pays one ``is None`` test.
- :class:`Authenticator` turns the credential a connection presents (a token,
  a verified client-certificate name, or nothing) into a :class:`Principal`
  or raises :class:`~broker.core.refusals.NotPermitted`, and counts live
  connections per user for ``max_connections``.

Tokens are never kept in clear: each user's token is held as its SHA-256
digest, a presented token is hashed and looked up by digest, and the match is
confirmed with :func:`hmac.compare_digest`.  Looking up a digest leaks
nothing about the token (an attacker cannot steer SHA-256 outputs), and the
comparison runs in constant time.

The enforcer (:mod:`broker.core.enforcement`, held by the router) is the one
place that applies these to connections, for every protocol.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from broker.core.bounded import BoundedCache
from broker.core.eventtypes import pattern_group
from broker.core.refusals import NotPermitted

# A group pattern (permissions, configuration) ends in this to mean "any rest".
GROUP_WILDCARD = "*"

# Verdicts cached per Permissions object (group -> bool).  The cache is
# cleared when full: a client sending to ever new group names cannot grow it
# without bound, and a miss is a few string comparisons.
PERMISSION_CACHE_LIMIT = 4096

# Labels of skan_permission_denied_total{action}.
PUBLISH = "publish"
SUBSCRIBE = "subscribe"

# How a connection authenticated (Principal.via).
VIA_TOKEN = "token"
VIA_CERTIFICATE = "certificate"
VIA_LISTENER_TOKEN = "listener-token"
VIA_ANONYMOUS = "anonymous"
# No credential, admitted by its listener's own ``anonymous_user``.
VIA_LISTENER_ANONYMOUS = "listener-anonymous"
VIA_BRIDGE = "bridge"


# What each protocol calls its token field, for refusal messages.
TOKEN_FIELDS = {"eventer": "client token (clientToken)", "mariner": "client_token"}


def token_digest(token: str | bytes) -> bytes:
    """SHA-256 of a token (UTF-8 when given as text)."""
    if isinstance(token, str):
        token = token.encode()
    return hashlib.sha256(token).digest()


def hash_token(token: str | bytes) -> str:
    """The ``token_sha256`` value for a token (what ``skan-broker hash-token`` prints)."""
    return token_digest(token).hex()


def group_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a valid group pattern, or None."""
    if not pattern:
        return "a group pattern must not be empty"
    if GROUP_WILDCARD in pattern[:-1]:
        return (f"group pattern {pattern!r}: '*' may only be the last character "
                "(a group name, '*', or a prefix ending in '*')")
    return None


class GroupPatterns:
    """A set of group patterns: a group name, ``*`` (every group) or a prefix ending in ``*``."""

    __slots__ = ("everything", "exact", "patterns", "prefixes")

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        for p in self.patterns:
            problem = group_pattern_problem(p)
            if problem is not None:
                raise ValueError(problem)
        self.everything = GROUP_WILDCARD in self.patterns
        self.exact = frozenset(p.encode() for p in self.patterns if not p.endswith(GROUP_WILDCARD))
        self.prefixes = tuple(p[:-1].encode() for p in self.patterns if p.endswith(GROUP_WILDCARD))

    def __call__(self, group: bytes) -> bool:
        if self.everything or group in self.exact:
            return True
        return any(group.startswith(p) for p in self.prefixes)

    def __repr__(self) -> str:
        return f"GroupPatterns({list(self.patterns)!r})"


class Permissions:
    """What one user's connections may do.  Verdicts are cached per group."""

    __slots__ = ("_pub_cache", "_sub_cache", "promisc", "publish", "publish_allowed",
                 "subscribe", "user")

    def __init__(self, user: str | None, publish: Iterable[str], subscribe: Iterable[str],
                 promisc: bool = False) -> None:
        self.user = user
        self.publish = GroupPatterns(publish)
        self.subscribe = GroupPatterns(subscribe)
        self.promisc = promisc
        # Groups known to be allowed: the router's hot path tests membership
        # (``group in publish_allowed``) without a call.  Same object for the
        # Permissions' lifetime (cleared, never replaced, when full).
        self.publish_allowed: set[bytes] = set()
        self._pub_cache: BoundedCache[bytes, bool] = BoundedCache(
            PERMISSION_CACHE_LIMIT, also=(self.publish_allowed,))
        self._sub_cache: BoundedCache[bytes, bool] = BoundedCache(PERMISSION_CACHE_LIMIT)

    def may_publish(self, group: bytes) -> bool:
        verdict = self._pub_cache.get(group)
        if verdict is None:
            verdict = self._pub_cache.put(group, self.publish(group))
            if verdict:
                self.publish_allowed.add(group)
        return verdict

    def may_subscribe(self, group: bytes) -> bool:
        verdict = self._sub_cache.get(group)
        if verdict is None:
            verdict = self._sub_cache.put(group, self.subscribe(group))
        return verdict

    def subscribe_problem(self, group: bytes, promisc: bool) -> str | None:
        """Why a subscription to ``group`` is refused, or None."""
        if not self.may_subscribe(group):
            return (f"not authorised: user {self._who()} may not subscribe to group "
                    f"{group.decode(errors='replace')!r}")
        if promisc and not self.promisc:
            return f"not authorised: user {self._who()} may not subscribe promisc"
        return None

    def publish_problem(self, group: bytes) -> str | None:
        if self.may_publish(group):
            return None
        return (f"not authorised: user {self._who()} may not send to group "
                f"{group.decode(errors='replace')!r}")

    def pattern_problem(self, pattern: tuple[bytes, ...], promisc: bool = False) -> str | None:
        """Why a Hat event-type pattern subscription is refused, or None.

        The group is the pattern's first segment; a first segment ``*`` or
        ``?`` reaches every group and needs the ``*`` subscribe permission.
        """
        shown = "[" + ", ".join(repr(s.decode(errors="replace")) for s in pattern) + "]"
        group = pattern_group(pattern)
        if pattern and group is None:
            if not self.subscribe.everything:
                return (f"not authorised: subscription {shown} reaches every group and user "
                        f"{self._who()} may not subscribe to all of them")
        elif group is not None and not self.may_subscribe(group):
            return (f"not authorised: subscription {shown} reaches group "
                    f"{group.decode(errors='replace')!r}, outside what user "
                    f"{self._who()} may subscribe to")
        if promisc and not self.promisc:
            return f"not authorised: user {self._who()} may not subscribe promisc"
        return None

    def _who(self) -> str:
        return repr(self.user) if self.user is not None else "(anonymous)"

    def __repr__(self) -> str:
        return (f"Permissions({self.user!r}, publish={list(self.publish.patterns)!r}, "
                f"subscribe={list(self.subscribe.patterns)!r}, promisc={self.promisc})")


class UserSpec(Protocol):
    """What the authenticator needs of one configured user (``[[users]]``)."""

    name: str
    token: str | None
    token_sha256: str | None
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    promisc: bool
    max_connections: int | None


@attrs.frozen
class User:
    name: str
    digest: bytes | None
    permissions: Permissions
    max_connections: int | None

    @classmethod
    def from_spec(cls, spec: UserSpec) -> User:
        if spec.token is not None:
            digest: bytes | None = token_digest(spec.token)
        elif spec.token_sha256 is not None:
            digest = bytes.fromhex(spec.token_sha256)
        else:
            digest = None  # certificate-only user
        perms = Permissions(spec.name, spec.publish, spec.subscribe, spec.promisc)
        return cls(spec.name, digest, perms, spec.max_connections)


@attrs.frozen
class Principal:
    """Who a connection is: a user name (None: anonymous), its permissions
    (None: full rights), how it authenticated and the credential's digest
    (so a reload can tell whether that credential still authenticates);
    ``listener``: the protocol whose ``anonymous_user`` admitted it."""

    name: str | None
    perms: Permissions | None
    via: str
    digest: bytes | None = None
    listener: str | None = None


def _not_authorised(detail: str) -> NotPermitted:
    """A refused credential: the connection is answered and closed."""
    return NotPermitted(f"not authorised: {detail}", close=True)


class Authenticator:
    """Credentials -> :class:`Principal`, and live connection counts per user."""

    def __init__(
        self,
        users: Iterable[User] = (),
        *,
        allow_anonymous: bool = True,
        anonymous_user: str | None = None,
        listener_tokens: Mapping[str, str | None] | None = None,
        listener_anonymous: Mapping[str, str | None] | None = None,
    ) -> None:
        self.users: dict[str, User] = {}
        self._by_digest: dict[bytes, User] = {}
        for user in users:
            self.users[user.name] = user
            if user.digest is not None:
                self._by_digest[user.digest] = user
        self.allow_anonymous = allow_anonymous
        if anonymous_user is not None and anonymous_user not in self.users:
            raise ValueError(f"anonymous_user {anonymous_user!r} is not a configured user")
        self.anonymous_user = anonymous_user
        # Shared per-listener tokens ([eventer] token, [mariner] token), used
        # only while no [[users]] exist.
        self.listener_tokens = {
            proto: token_digest(tok) for proto, tok in (listener_tokens or {}).items()
            if tok is not None
        }
        # Per listener (protocol -> user name): connections of that protocol
        # that present no credential get this user's permissions, whether or
        # not anonymous clients are allowed elsewhere.  For Hat components
        # (hat-gateway, hat-gui), which have no client-token setting.
        self.listener_anonymous = {
            proto: name for proto, name in (listener_anonymous or {}).items()
            if name is not None
        }
        for proto, name in self.listener_anonymous.items():
            if name not in self.users:
                raise ValueError(f"{proto}.anonymous_user {name!r} is not a configured user")
        # user name -> live connections (kept across reloads by the router).
        self.connections: dict[str, int] = {}

    @classmethod
    def from_specs(cls, specs: Iterable[UserSpec], **kwargs) -> Authenticator:
        return cls([User.from_spec(s) for s in specs], **kwargs)

    # ---- authentication ---------------------------------------------------

    def _anonymous(self, protocol: str | None = None) -> Principal:
        listener_user = self.listener_anonymous.get(protocol or "")
        if listener_user is not None:
            user = self.users[listener_user]
            return Principal(user.name, user.permissions, VIA_LISTENER_ANONYMOUS,
                             listener=protocol)
        if not self.allow_anonymous:
            raise _not_authorised(
                "anonymous clients are not allowed here; present a token or a client certificate"
            )
        if self.anonymous_user is not None:
            user = self.users[self.anonymous_user]
            return Principal(None, user.permissions, VIA_ANONYMOUS)
        return Principal(None, None, VIA_ANONYMOUS)

    def authenticate(
        self, protocol: str, token: str | bytes | None, cert_name: str | None = None
    ) -> Principal:
        """Who presents ``token`` (None: no token) and a verified certificate
        name ``cert_name`` (None: no certificate) on ``protocol``.  Raises
        :class:`NotPermitted` (``close`` set) for a credential refused.

        A token, when presented, decides; otherwise a certificate whose name
        is a user's; otherwise the connection is anonymous: its listener's
        ``anonymous_user`` if it has one, else the ``[auth]`` rules.
        """
        if not self.users:
            shared = self.listener_tokens.get(protocol)
            if shared is not None:
                # [eventer] token / [mariner] token: a missing token does not match.
                if token is not None and hmac.compare_digest(token_digest(token), shared):
                    return Principal(None, None, VIA_LISTENER_TOKEN, shared)
                field = TOKEN_FIELDS.get(protocol, "token")
                raise _not_authorised(f"{field} does not match")
            return self._anonymous()
        if token is not None:
            digest = token_digest(token)
            user = self._by_digest.get(digest)
            if user is None or user.digest is None or not hmac.compare_digest(
                digest, user.digest
            ):
                raise _not_authorised("the token does not match any user")
            return Principal(user.name, user.permissions, VIA_TOKEN, digest)
        if cert_name is not None:
            user = self.users.get(cert_name)
            if user is not None:
                return Principal(user.name, user.permissions, VIA_CERTIFICATE)
        return self._anonymous(protocol)

    def bridge_principal(self, user_name: str | None) -> Principal:
        """Bridges act as their configured ``user`` (None: full rights)."""
        if user_name is None:
            return Principal(None, None, VIA_BRIDGE)
        user = self.users.get(user_name)
        if user is None:
            # Config validation prevents this; a reload that removed the user
            # leaves the bridge with no rights rather than full ones.
            return Principal(user_name, Permissions(user_name, (), ()), VIA_BRIDGE)
        return Principal(user.name, user.permissions, VIA_BRIDGE)

    def still_valid(self, principal: Principal) -> Principal | None:
        """``principal`` under this (reloaded) configuration, or None when the
        credential it authenticated with no longer does (user removed, token
        changed, anonymous access withdrawn)."""
        if principal.via == VIA_BRIDGE:
            return self.bridge_principal(principal.name)
        if principal.via == VIA_LISTENER_TOKEN:
            if self.users:
                return None
            if principal.digest in self.listener_tokens.values():
                return principal
            return None
        if principal.via == VIA_ANONYMOUS:
            try:
                return self._anonymous()
            except NotPermitted:
                return None
        if principal.via == VIA_LISTENER_ANONYMOUS:
            # Still admitted by its listener, as the same user (connections
            # are counted per user name): else closed, and a reconnect is
            # judged by the new rules.
            try:
                result = self._anonymous(principal.listener)
            except NotPermitted:
                return None
            if result.via == VIA_LISTENER_ANONYMOUS and result.name == principal.name:
                return result
            return None
        user = self.users.get(principal.name or "")
        if user is None:
            return None
        if principal.via == VIA_TOKEN and (
            user.digest is None or principal.digest is None
            or not hmac.compare_digest(user.digest, principal.digest)
        ):
            return None
        return attrs.evolve(principal, perms=user.permissions)

    # ---- connection counts ------------------------------------------------

    def acquire(self, principal: Principal) -> None:
        """Count one more connection of ``principal``'s user; past its limit
        raise :class:`NotPermitted` (``close`` set), nothing counted."""
        name = principal.name
        if name is None or principal.via == VIA_BRIDGE:
            return
        user = self.users.get(name)
        count = self.connections.get(name, 0)
        if user is not None and user.max_connections is not None and (
            count >= user.max_connections
        ):
            raise _not_authorised(
                f"user {name!r} already has {count} connections (max_connections)"
            )
        self.connections[name] = count + 1

    def release(self, principal: Principal) -> None:
        name = principal.name
        if name is None or principal.via == VIA_BRIDGE:
            return
        count = self.connections.get(name, 0) - 1
        if count > 0:
            self.connections[name] = count
        else:
            self.connections.pop(name, None)
