"""The pure authentication and permission rules of section 7 (broker/core/auth.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from broker.core.auth import (
    Authenticator,
    GroupPatterns,
    Permissions,
    Principal,
    User,
    hash_token,
)
from broker.core.refusals import NotPermitted
from broker.core.router import NORMAL, PROMISC, Router
from tests.brokerproc import ROOT
from tests.security.common import Sink


def user(name: str, token: str | None = None, publish=(), subscribe=(), promisc=False,
         max_connections=None) -> User:
    digest = None if token is None else hashlib.sha256(token.encode()).digest()
    return User(name, digest, Permissions(name, publish, subscribe, promisc), max_connections)


def refusal(auth: Authenticator, protocol: str, token, cert_name=None) -> NotPermitted:
    """The refusal ``auth`` raises for this credential (it must raise one)."""
    with pytest.raises(NotPermitted) as info:
        auth.authenticate(protocol, token, cert_name)
    assert info.value.close  # a refused credential ends the connection
    return info.value


def login(router: Router, ep, token) -> str | None:
    """None when the login is accepted, else the refusal's reason."""
    try:
        router.enforcer.login(ep, token)
    except NotPermitted as exc:
        assert exc.close
        return exc.reason
    return None


def test_group_patterns():
    m = GroupPatterns(["telemetry", "alarms.*"])
    assert m(b"telemetry") and m(b"alarms.fire") and m(b"alarms.")
    assert not m(b"telemetry2") and not m(b"alarms") and not m(b"x")
    assert GroupPatterns(["*"])(b"anything")
    assert not GroupPatterns([])(b"x")
    for bad in ["", "a*b", "**"]:
        with pytest.raises(ValueError):
            GroupPatterns([bad])


def test_hash_token_is_sha256_hex():
    assert hash_token("s3cret") == hashlib.sha256(b"s3cret").hexdigest()


def test_hash_token_command():
    proc = subprocess.run([sys.executable, "-m", "broker", "hash-token"], input="s3cret\n",
                          capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert proc.returncode == 0
    assert proc.stdout.strip() == hashlib.sha256(b"s3cret").hexdigest()


def test_token_lookup_and_refusals():
    auth = Authenticator([user("a", "ta"), user("b", "tb"), user("cert-only")],
                         allow_anonymous=False)
    p = auth.authenticate("skan", b"ta")
    assert isinstance(p, Principal) and p.name == "a" and p.via == "token"
    assert auth.authenticate("skan", "tb").name == "b"
    assert refusal(auth, "skan", b"nope").reason.startswith("not authorised: ")
    assert "anonymous" in refusal(auth, "skan", None).reason
    # A verified certificate whose CN is a user's name authenticates as that user.
    assert auth.authenticate("skan", None, "cert-only").name == "cert-only"
    # ... but not an unknown name (then the connection is anonymous: refused here).
    refusal(auth, "skan", None, "stranger")
    # A presented token decides, even with a certificate.
    refusal(auth, "skan", b"bad", "cert-only")


def test_anonymous_user_permissions():
    auth = Authenticator([user("guest", None, publish=["pub"], subscribe=["sub"])],
                         allow_anonymous=True, anonymous_user="guest")
    p = auth.authenticate("hsp", None)
    assert isinstance(p, Principal) and p.name is None
    assert p.perms is not None and p.perms.may_publish(b"pub") and not p.perms.may_publish(b"x")
    open_auth = Authenticator()
    assert open_auth.authenticate("skan", None).perms is None  # full rights


def test_listener_token_without_users():
    auth = Authenticator(listener_tokens={"eventer": "s3cret", "mariner": None})
    assert isinstance(auth.authenticate("eventer", "s3cret"), Principal)
    refusal(auth, "eventer", "wrong")
    refusal(auth, "eventer", None)  # missing does not match
    # Other listeners are unaffected by the Eventer token.
    assert isinstance(auth.authenticate("skan", None), Principal)
    assert isinstance(auth.authenticate("mariner", None), Principal)
    # Once users exist the shared token no longer applies.
    with_users = Authenticator([user("u", "tu")], listener_tokens={"eventer": "s3cret"},
                               allow_anonymous=False)
    refusal(with_users, "eventer", "s3cret")
    assert with_users.authenticate("eventer", "tu").name == "u"


def test_max_connections_counted_in_the_router():
    router = Router(hostname="t")
    router.enforcer.auth = Authenticator([user("op", "t", max_connections=2)],
                                         allow_anonymous=False)
    eps = [Sink() for _ in range(3)]
    for ep in eps:
        router.attach(ep)
    assert login(router, eps[0], b"t") is None
    assert login(router, eps[1], b"t") is None
    refused = login(router, eps[2], b"t")
    assert refused is not None and "max_connections" in refused
    assert router.counters.auth_failures == {"skan": 1}
    router.detach(eps[0])
    assert login(router, eps[2], b"t") is None


def test_router_refuses_sends_and_subscriptions_outside_permissions():
    router = Router(hostname="t")
    router.enforcer.auth = Authenticator(
        [user("s", "t", publish=["telemetry"], subscribe=["cmd.*"])], allow_anonymous=False)
    ep = Sink()
    router.attach(ep)
    assert login(router, ep, b"t") is None
    with pytest.raises(NotPermitted, match="may not subscribe to group 'telemetry'"):
        router.subscribe(ep, b"telemetry", b"*", NORMAL)
    with pytest.raises(NotPermitted, match="promisc"):
        router.subscribe(ep, b"cmd.x", b"*", PROMISC)
    router.subscribe(ep, b"cmd.x", b"*", NORMAL)
    with pytest.raises(NotPermitted, match="reaches every group"):
        router.subscribe_pattern(ep, (b"?", b"x"))
    with pytest.raises(NotPermitted, match="reaches group 'telemetry'"):
        router.subscribe_pattern(ep, (b"telemetry", b"*"))
    router.subscribe_pattern(ep, (b"cmd.y", b"*"))
    assert router.subscription_count == 2
    assert router.counters.permission_denied == {"skan:subscribe": 4}


def test_reload_keeps_connection_counts_and_applies_new_limits():
    router = Router(hostname="t")
    router.enforcer.auth = Authenticator([user("op", "t")], allow_anonymous=False)
    eps = [Sink() for _ in range(3)]
    for ep in eps:
        router.attach(ep)
    assert login(router, eps[0], b"t") is None and login(router, eps[1], b"t") is None
    # The limit drops to 1 while 2 are connected: they stay, the next is refused.
    assert router.reload_auth(Authenticator([user("op", "t", max_connections=1)],
                                            allow_anonymous=False)) == []
    assert "max_connections" in (login(router, eps[2], b"t") or "")
    router.detach(eps[0])
    router.detach(eps[1])
    assert login(router, eps[2], b"t") is None
    # A changed token revokes the connections that used the old one.
    assert router.reload_auth(Authenticator([user("op", "new")],
                                            allow_anonymous=False)) == [eps[2]]


def test_listener_anonymous_user_admits_only_that_listeners_token_less_clients():
    """Section 11: token-less Hat components on the Eventer listener get a
    limited user of their own; anonymous clients elsewhere stay refused."""
    users = [user("hat", None, publish=["gateway"], subscribe=["gateway"], max_connections=2),
             user("op", "top", publish=["*"], subscribe=["*"])]
    auth = Authenticator(users, allow_anonymous=False, listener_anonymous={"eventer": "hat"})
    p = auth.authenticate("eventer", None)
    assert isinstance(p, Principal) and p.name == "hat" and p.via == "listener-anonymous"
    assert p.perms is not None and p.perms.may_publish(b"gateway")
    assert not p.perms.may_publish(b"other")
    for proto in ("skan", "hsp", "mariner"):
        refusal(auth, proto, None)
    # A token still decides on that listener: a wrong one is refused, not anonymous.
    assert auth.authenticate("eventer", "top").name == "op"
    refusal(auth, "eventer", "wrong")
    # It takes precedence over [auth] anonymous_user on its listener.
    both = Authenticator(users, allow_anonymous=True, anonymous_user="op",
                         listener_anonymous={"eventer": "hat"})
    assert both.authenticate("eventer", None).name == "hat"
    assert both.authenticate("skan", None).perms is users[1].permissions
    with pytest.raises(ValueError, match="not a configured user"):
        Authenticator(users, listener_anonymous={"eventer": "ghost"})


def test_listener_anonymous_connections_count_against_the_user_and_follow_reloads():
    router = Router(hostname="t")
    users = [user("hat", None, publish=["gateway"], subscribe=["gateway"], max_connections=2)]
    router.enforcer.auth = Authenticator(users, allow_anonymous=False,
                                listener_anonymous={"eventer": "hat"})
    eps = [Sink("eventer") for _ in range(3)]
    for ep in eps:
        router.attach(ep)
    assert login(router, eps[0], None) is None and login(router, eps[1], None) is None
    assert "max_connections" in (login(router, eps[2], None) or "")
    # The same setting kept: connections stay, with the reloaded permissions.
    wider = [user("hat", None, publish=["gateway", "gui"], subscribe=["gateway"])]
    assert router.reload_auth(Authenticator(wider, allow_anonymous=False,
                                            listener_anonymous={"eventer": "hat"})) == []
    assert eps[0].perms is not None and eps[0].perms.may_publish(b"gui")
    # The setting removed: they are closed (anonymous is not allowed).
    assert router.reload_auth(Authenticator(wider, allow_anonymous=False)) == eps[:2]
