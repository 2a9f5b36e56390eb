"""[auth], [[users]], tls_ca/tls_client_auth and bridge users: validated with key and reason."""

from __future__ import annotations

import hashlib

import pytest

from broker.serving import config as cfgmod

USER = {"name": "u", "token": "t"}


@pytest.mark.parametrize(("data", "key", "reason"), [
    ({"users": [{"name": "u", "token": "t", "token_sha256": "a" * 64}]}, "users[0].token",
     "not both"),
    ({"users": [USER, USER]}, "users[1].name", "defined twice"),
    ({"users": [USER, {"name": "v", "token_sha256": hashlib.sha256(b"t").hexdigest().upper()}]},
     "users[1].token", "the same token as user 'u'"),
    ({"users": [{"name": ""}]}, "users[0].name", "must not be empty"),
    ({"users": [{"name": "u", "token": ""}]}, "users[0].token", "must not be empty"),
    ({"users": [{"name": "u", "token_sha256": "xyz"}]}, "users[0].token_sha256", "64 hex"),
    ({"users": [{"name": "u", "publish": ["a*b"]}]}, "users[0].publish", "last character"),
    ({"users": [{"name": "u", "subscribe": [""]}]}, "users[0].subscribe", "empty"),
    ({"users": [{"name": "u", "max_connections": 0}]}, "users[0].max_connections",
     "greater than 0"),
    ({"users": [{"name": "u", "promisc": "yes"}]}, "users[0].promisc", "must be a bool"),
    ({"users": [{"name": "u", "colour": "red"}]}, "users[0].colour", "unknown key"),
    ({"users": {"name": "u"}}, "users", "array of tables"),
    ({"auth": {"anonymous_user": "ghost"}}, "auth.anonymous_user", "not the name"),
    ({"eventer": {"anonymous_user": "ghost"}}, "eventer.anonymous_user", "not the name"),
    ({"auth": {"allow_anonymous": "no"}}, "auth.allow_anonymous", "must be a bool"),
    ({"skan": {"tls_client_auth": "require"}}, "skan.tls_client_auth", "need tls_ca"),
    ({"skan": {"tls_client_auth": "maybe"}}, "skan.tls_client_auth", "must be one of"),
    ({"hsp": {"tls_ca": "ca.pem"}}, "hsp.tls_ca", "needs tls_cert"),
    ({"metrics": {"tls_cert": "c", "tls_key": "k", "tls_ca": "ca", "tls_client_auth": "optional"}},
     "metrics.tls_client_auth", "'none' or 'require'"),
    ({"metrics": {"token": "t", "token_sha256": "a" * 64}}, "metrics.token", "not both"),
    ({"metrics": {"username": "prom"}}, "metrics.username", "needs password"),
    ({"metrics": {"password": "pw"}}, "metrics.password", "needs username"),
    ({"metrics": {"username": "a:b", "password": "pw"}}, "metrics.username", "':'"),
    ({"metrics": {"password_sha256": "xyz", "username": "u"}}, "metrics.password_sha256",
     "64 hex digits"),
    ({"bridges": [{"protocol": "hsp", "address": "h:1", "group": "g", "tls_cert": "c"}]},
     "bridges[0].tls_cert", "tls = true"),
])
def test_refused_with_key_and_reason(data, key, reason):
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.from_mapping(data)
    assert info.value.key == key
    assert reason in info.value.reason


def test_anonymous_defaults():
    loopback = cfgmod.from_mapping({})
    assert cfgmod.anonymous_allowed(loopback)
    cfgmod.check_exposure(loopback)
    with_users = cfgmod.from_mapping({"users": [USER]})
    assert not cfgmod.anonymous_allowed(with_users)
    explicit = cfgmod.from_mapping({"users": [USER], "auth": {"allow_anonymous": True}})
    assert cfgmod.anonymous_allowed(explicit)
    for host in ("0.0.0.0", "192.168.1.5", "::", "broker.example"):
        exposed = cfgmod.override(loopback, host=host)
        with pytest.raises(cfgmod.ConfigError) as info:
            cfgmod.check_exposure(exposed)
        assert info.value.key == "auth.allow_anonymous" and host in info.value.reason
        assert not cfgmod.anonymous_allowed(exposed)
        cfgmod.check_exposure(cfgmod.override(with_users, host=host))
    for host in ("127.0.0.1", "127.0.1.1", "::1", "localhost"):
        cfgmod.check_exposure(cfgmod.override(loopback, host=host))


def test_example_users_load():
    cfg = cfgmod.from_mapping({
        "auth": {"allow_anonymous": False, "anonymous_user": "guest"},
        "users": [{"name": "guest", "subscribe": ["public.*"]},
                  {"name": "s", "token_sha256": "A" * 64, "publish": ["t", "a.*"],
                   "max_connections": 3}],
    })
    auth = cfgmod.build_authenticator(cfg)
    assert set(auth.users) == {"guest", "s"}
    assert auth.listener_anonymous == {}
    hat = cfgmod.from_mapping({"auth": {"allow_anonymous": False},
                               "eventer": {"anonymous_user": "hat"},
                               "users": [{"name": "hat", "publish": ["gateway"]}]})
    assert cfgmod.build_authenticator(hat).listener_anonymous == {"eventer": "hat"}
    assert auth.users["s"].max_connections == 3
