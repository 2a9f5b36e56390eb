"""Permission enforcement (BROKER-SPEC section 7): who a connection is, what it may do.

In the manner of nats-server, which keeps each client's publish and
subscribe permissions (with its publish-verdict cache) apart from the
sublist that finds recipients: the :class:`Enforcer` authenticates
connections, gives each endpoint its principal and permissions, and
refuses what they do not allow; the subscription index
(``broker/core/sublist.py``) and the router's delivery know nothing of
users.  The router holds one enforcer and asks it before it routes a send
(replies included: a reply is a send) or changes the index; the index asks
:func:`may_get_reply` who may receive a reply.

The hot path does not call in here for a group already known to be allowed:
``Router.route`` tests ``group in endpoint.publish_allowed`` (the
permissions' own set of allowed groups, filled by
:meth:`~broker.core.auth.Permissions.may_publish`) and calls
:meth:`Enforcer.check_publish` only on a miss; full rights
(``publish_allowed`` None) cost an ``is None``.

Refusals are raised (:class:`~broker.core.refusals.NotPermitted`) and counted
here once.  Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from broker.core.auth import PUBLISH, SUBSCRIBE, Authenticator, Permissions, Principal
from broker.core.counters import Counters
from broker.core.eventtypes import STAR
from broker.core.refusals import NotPermitted


class Guarded(Protocol):
    """What enforcement needs of an endpoint (``broker.core.router.Endpoint``)."""

    protocol: str
    lname: bytes
    # Subject CN of a verified TLS client certificate (None: none).
    cert_name: str | None
    principal: Principal | None
    # None: full rights.
    perms: Permissions | None
    # ``perms.publish_allowed`` (None with full rights), for the hot path.
    publish_allowed: set[bytes] | None


def set_permissions(endpoint: Guarded, perms: Permissions | None) -> None:
    """Give ``endpoint`` ``perms`` (None: full rights), with the hot path's set."""
    endpoint.perms = perms
    endpoint.publish_allowed = None if perms is None else perms.publish_allowed


def may_get_reply(perms: Permissions | None, group: bytes) -> bool:
    """A reply reaches its requester (whose permissions are ``perms``)
    regardless of subscriptions, but only in a group the requester may
    subscribe to (as NATS asks for subscribe permission on reply subjects)."""
    return perms is None or perms.may_subscribe(group)


class Enforcer:
    """Credentials to principals, and the permission checks, for every protocol."""

    __slots__ = ("auth", "counters")

    def __init__(self, counters: Counters, auth: Authenticator | None = None) -> None:
        self.counters = counters
        # Users and credentials; replaced on reload (:meth:`reload`).
        self.auth = auth if auth is not None else Authenticator()

    # ---- who a connection is ------------------------------------------------

    def login(self, endpoint: Guarded, token: str | bytes | None) -> None:
        """Authenticate a connection from its token and/or certificate name
        (``endpoint.cert_name``); it then carries its principal and permissions.

        Raises :class:`NotPermitted` (``close`` set; counted in
        ``auth_failures``): the adapter answers and closes.
        """
        auth = self.auth
        try:
            principal = auth.authenticate(endpoint.protocol, token, endpoint.cert_name)
            auth.acquire(principal)
        except NotPermitted:
            self.counters.auth_failure(endpoint.protocol)
            raise
        self._set_principal(endpoint, principal)

    def login_bridge(self, endpoint: Guarded, user: str | None) -> None:
        """Bridges act as their configured ``user`` (None: full rights)."""
        self._set_principal(endpoint, self.auth.bridge_principal(user))

    def release(self, endpoint: Guarded) -> None:
        """A connection is gone: its user's connection count drops."""
        if endpoint.principal is not None:
            self.auth.release(endpoint.principal)

    def _set_principal(self, endpoint: Guarded, principal: Principal) -> None:
        self.release(endpoint)  # (bridges are never counted)
        endpoint.principal = principal
        set_permissions(endpoint, principal.perms)

    def reload(self, auth: Authenticator, endpoints: Iterable[Guarded]) -> list[Guarded]:
        """Switch to a reloaded configuration of users and permissions.

        Live connections keep their principal with the new permissions.
        Returns the endpoints whose credential no longer authenticates
        (removed user, changed token, anonymous access withdrawn), left as
        they were: the caller closes them.  Which subscriptions the new
        permissions refuse is :meth:`refused_subscriptions`'.
        """
        auth.connections = self.auth.connections
        self.auth = auth
        revoked: list[Guarded] = []
        for ep in endpoints:
            old = ep.principal
            if old is None:
                continue
            new = auth.still_valid(old)
            if new is None:
                revoked.append(ep)
                continue
            ep.principal = new
            set_permissions(ep, new.perms)
        return revoked

    # ---- what it may do ------------------------------------------------------

    def _refuse(self, endpoint: Guarded, action: str, problem: str | None) -> None:
        if problem is not None:
            self.counters.denied(endpoint.protocol, action)
            raise NotPermitted(problem)

    def check_publish(self, endpoint: Guarded, group: bytes) -> None:
        """Raise :class:`NotPermitted` (counted) if ``endpoint`` may not send to ``group``."""
        perms = endpoint.perms
        if perms is not None:
            self._refuse(endpoint, PUBLISH, perms.publish_problem(group))

    def check_subscribe(self, endpoint: Guarded, group: bytes, promisc: bool) -> None:
        """Raise :class:`NotPermitted` (counted) if ``endpoint`` may not subscribe
        to ``group`` (promisc or not)."""
        perms = endpoint.perms
        if perms is not None:
            self._refuse(endpoint, SUBSCRIBE, perms.subscribe_problem(group, promisc))

    def check_pattern(self, endpoint: Guarded, pattern: tuple[bytes, ...],
                      promisc: bool) -> None:
        """Raise :class:`NotPermitted` (counted) if a Hat pattern subscription
        reaches a group outside ``endpoint``'s subscribe permissions."""
        perms = endpoint.perms
        if perms is not None:
            self._refuse(endpoint, SUBSCRIBE, perms.pattern_problem(pattern, promisc))

    @staticmethod
    def may_read(endpoint: Guarded, group: bytes, to: bytes) -> bool:
        """Could ``endpoint`` receive a message of ``group`` addressed ``to``
        through a subscription it is permitted?  (Eventer queries over
        retained messages use it.)  Directed messages to others need promisc."""
        perms = endpoint.perms
        if perms is None:
            return True
        if not perms.may_subscribe(group):
            return False
        return to == STAR or to == endpoint.lname or perms.promisc

    @staticmethod
    def refused_subscriptions(
        endpoint: Guarded,
        instances: Iterable[tuple[bytes, bytes, bool]],
        patterns: Iterable[tuple[tuple[bytes, ...], bool]],
    ) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, ...]]]:
        """Of ``endpoint``'s subscriptions, given as ``(group, instance,
        promisc)`` and ``(pattern, promisc)``, those its permissions no longer
        allow: ``(group, instance)`` pairs and patterns (after a reload)."""
        perms = endpoint.perms
        if perms is None:
            return [], []
        return (
            [(g, i) for g, i, promisc in instances
             if perms.subscribe_problem(g, promisc) is not None],
            [p for p, promisc in patterns if perms.pattern_problem(p, promisc) is not None],
        )
