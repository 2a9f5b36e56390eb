"""Broker configuration: attrs classes, TOML loading, validation, flag overrides.

Every section of the TOML file maps to one frozen attrs class.  Loading is
strict: an unknown key, a value of the wrong type or out of range is refused
with a :class:`ConfigError` naming the key (``hsp.ping_delay``) and the
reason, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs

from broker.core.auth import Authenticator, group_pattern_problem, hash_token
from broker.core.eventtypes import pattern_problem
from broker.core.queue import MIN_QUEUE_LIMIT
from broker.core.router import DEFAULT_MAX_SUBSCRIPTIONS

MiB = 1024 * 1024
# Python's logging level names, accepted in any case (stored lower case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A configuration value was refused; ``key`` is the dotted path.

    One error, or several (``errors``: every refused key of a file, reported
    at once; ``key`` and ``reason`` are then the first's).  ``text`` replaces
    the usual "config key ..." line (a file that is not TOML).
    """

    def __init__(self, key: str, reason: str, *, text: str | None = None,
                 errors: list[ConfigError] | None = None) -> None:
        super().__init__(text or f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason
        self.errors: list[ConfigError] = errors if errors is not None else [self]

    @classmethod
    def of(cls, errors: list[ConfigError]) -> ConfigError:
        """One error for a list of them (the list's only one, or all of them)."""
        flat = [e for err in errors for e in err.errors]
        if len(flat) == 1:
            return flat[0]
        lines = "\n".join(f"  {e}" for e in flat)
        return cls(flat[0].key, flat[0].reason, errors=flat,
                   text=f"{len(flat)} configuration errors:\n{lines}")


def _port(inst: Any, attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535 (0 picks a free port)")


def _positive(inst: Any, attr: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError("must be greater than 0")


def _non_negative(inst: Any, attr: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError("must not be negative")


def _optional_positive(inst: Any, attr: attrs.Attribute, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError("must be greater than 0 (leave it out for no limit of its own)")


def _nice(inst: Any, attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 19:
        raise ValueError("must be from 0 to 19 (a nice increment)")


def _one_of(*choices: str):
    def check(inst: Any, attr: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}")

    return check


@attrs.frozen
class BrokerSection:
    host: str = "127.0.0.1"
    # EventId server component (Hat server_id); identifies this broker to Hat peers.
    server_id: int = attrs.field(default=1, validator=_non_negative)
    # Largest accepted Skan frame.  Bounds the memory one connection can make
    # the broker buffer before the frame is complete; larger frames close it.
    max_frame: int = attrs.field(default=8 * MiB, validator=_positive)
    # Bytes queued towards one connection before the slow-consumer policy
    # applies.  Must hold at least one max-size frame.
    queue_limit: int = attrs.field(default=16 * MiB, validator=_positive)
    slow_consumer: str = attrs.field(default="disconnect", validator=_one_of("disconnect", "drop"))
    # Seconds publishers are paused (back-pressure) for a consumer whose queue
    # is over half full before the slow-consumer policy is left to act.
    slow_consumer_grace: float = attrs.field(default=1.0, validator=_non_negative)
    # Seconds a graceful stop waits for queued frames to drain to clients.
    drain_timeout: float = attrs.field(default=5.0, validator=_non_negative)
    # Diagnostics on stderr: level and "text" (one line per record) or "json"
    # (one JSON object per line, for log shippers).  Flags override both.
    log_level: str = attrs.field(default="info", converter=str.lower,
                                 validator=_one_of(*LOG_LEVELS))
    log_format: str = attrs.field(default="text", validator=_one_of(*LOG_FORMATS))
    # Client connections of all listeners together (section 9); past it a new
    # connection gets its protocol's refusal and is closed.  Lowered at start
    # (with a warning) when the descriptor limit cannot hold this many.
    max_connections: int = attrs.field(default=10_000, validator=_positive)
    # Seconds from accept to the end of the protocol's opening (Skan getlname,
    # HSP first message, Eventer MsgInitReq, Mariner init).
    handshake_timeout: float = attrs.field(default=10.0, validator=_positive)
    # Seconds a frame that has begun may take to arrive completely.
    frame_timeout: float = attrs.field(default=30.0, validator=_positive)
    # Bind client listeners with SO_REUSEPORT, so several broker processes
    # (``--workers``) share the ports and the kernel spreads connections.
    reuse_port: bool = False
    # Subscriptions (Skan instance subscriptions plus Hat patterns) one
    # connection may hold; past it a subscribe is refused (counted).
    max_subscriptions: int = attrs.field(
        default=DEFAULT_MAX_SUBSCRIPTIONS, validator=_positive
    )
    # Scheduler hints (broker/serving/scheduling.py): the routing thread's
    # slice in seconds, so it preempts a writer thread when a message arrives
    # (0: the kernel's default; Linux 6.12+ takes 0.0001 to 0.1) ...
    routing_slice: float = attrs.field(default=100e-6, validator=_non_negative)
    # ... and the nice increment of the durable store's writer thread (0: as
    # the routing thread; at most 19).  The routing log's is [log] writer_nice.
    writer_nice: int = attrs.field(default=10, validator=_nice)
    # ... and both writer threads (store and routing log) under SCHED_IDLE
    # while they keep up, back at their nice value while behind; only where
    # the broker may raise them back (root, CAP_SYS_NICE or RLIMIT_NICE).
    writer_idle: bool = True
    # Route reads of plain TCP connections straight from the broker's own
    # epoll loop, with trio as its guest (broker/serving/hostloop.py): an
    # isolated message then costs no trio scheduler pass.  False: plain
    # trio.run, every read through a task.
    host_loop: bool = True


def _port_field(default: int) -> Any:
    return attrs.field(default=default, validator=_port)


TLS_CLIENT_AUTH = ("none", "optional", "require")


@attrs.frozen
class _Listener:
    """What every listener section has: its port and TLS (cert and key together).

    ``tls_ca`` and ``tls_client_auth`` (section 7): client certificates signed
    by that CA are asked for ("optional") or required ("require"); a verified
    certificate whose subject CN is a user's name authenticates as that user.
    """

    port: int = _port_field(0)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: str = attrs.field(default="none", validator=_one_of(*TLS_CLIENT_AUTH))


@attrs.frozen
class ProtocolListener(_Listener):
    """A listener of client connections (Skan, HSP, Eventer, Mariner)."""

    # This listener's own connection limit, within [broker] max_connections.
    max_connections: int | None = attrs.field(default=None, validator=_optional_positive)
    # A [[users]] name: this listener's clients that present no credential
    # get that user's permissions, even with [auth] allow_anonymous = false
    # (section 11: Hat components have no client-token setting).
    anonymous_user: str | None = None


@attrs.frozen
class SkanSection(ProtocolListener):
    port: int = _port_field(9912)


@attrs.frozen
class _PeerListener(ProtocolListener):
    """A listener that can be turned off and keeps idle peers alive with pings."""

    enabled: bool = True
    ping_delay: float = attrs.field(default=30.0, validator=_positive)
    ping_timeout: float = attrs.field(default=10.0, validator=_positive)


@attrs.frozen
class HSPSection(_PeerListener):
    port: int = _port_field(9913)


@attrs.frozen
class EventerSection(_PeerListener):
    port: int = _port_field(23012)
    token: str | None = None


@attrs.frozen
class MarinerSection(_PeerListener):
    port: int = _port_field(23014)
    token: str | None = None


def _hex_sha256(inst: Any, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and (len(value) != 64 or any(c not in "0123456789abcdefABCDEF"
                                                      for c in value)):
        raise ValueError("must be 64 hex digits (skan-broker hash-token prints it)")


@attrs.frozen
class MetricsSection(_Listener):
    port: int = _port_field(9914)
    enabled: bool = True
    # Address the metrics listener binds; None: [broker] host.  Lets the
    # scrape port sit on a management network apart from client traffic.
    host: str | None = None
    # Per-group series are exported only for these groups plus the top-N
    # groups by traffic: one series per arbitrary group name would let any
    # client blow up the scrape size and Prometheus' memory.
    groups: tuple[str, ...] = ()
    top_groups: int = attrs.field(default=10, validator=_non_negative)
    # Credentials every request but /healthz must carry once one is set
    # (docs/metrics.md "Protection"): a bearer token (Prometheus'
    # ``authorization: credentials:``) and/or a user name and password
    # (``basic_auth:``), each in plain text or as its SHA-256 (skan-broker
    # hash-token), as users' tokens are.  With none of them (and no required
    # client certificate) /metrics is open as before and the connection
    # listing is served only on a loopback bind.
    token: str | None = None
    token_sha256: str | None = attrs.field(default=None, validator=_hex_sha256)
    username: str | None = None
    password: str | None = None
    password_sha256: str | None = attrs.field(default=None, validator=_hex_sha256)


@attrs.frozen
class LogSection:
    enabled: bool = True
    dir: str = "var/routing-log"
    # Rotate a file when it reaches this many bytes or this age, whichever first.
    rotate_bytes: int = attrs.field(default=64 * MiB, validator=_positive)
    rotate_seconds: float = attrs.field(default=60.0, validator=_positive)
    # File format (docs/routing-log.md): Parquet with zstd, or JSON Lines.
    format: str = attrs.field(default="parquet", validator=_one_of("parquet", "jsonl"))
    # Records buffered between the router and the writer thread before
    # when_full applies: "drop" counts and drops further records, routing
    # goes on; "backpressure" closes the admission gate until the writer
    # has caught up.
    queue_records: int = attrs.field(default=200_000, validator=_positive)
    when_full: str = attrs.field(default="drop", validator=_one_of("drop", "backpressure"))
    # The routing-log writer thread's nice increment.  0: measured, a writer
    # at nice 10 on a machine loaded by other processes fell behind a 30 s
    # 1->1 flood (39% of the records dropped) while at 0 it kept up (peak
    # queue 43,000 records) and its short per-batch work did not make
    # routing later in process (docs/routing-log.md, "Performance").
    writer_nice: int = attrs.field(default=0, validator=_nice)
    # Retention: the oldest complete files are removed once all complete files
    # together pass max_bytes, or a file is older than max_age seconds (0 = no
    # limit).  A routing log left alone must not fill the disk; 1 GiB is 16
    # files at the default rotate_bytes, a week covers a weekly Spark report.
    max_bytes: int = attrs.field(default=1024 * MiB, validator=_non_negative)
    max_age: float = attrs.field(default=7 * 24 * 3600.0, validator=_non_negative)


@attrs.frozen
class RetentionSection:
    # Routed messages kept for Eventer queries and Mariner replay (a ring).
    size: int = attrs.field(default=100_000, validator=_non_negative)
    # Bytes of retained frames (0: no byte bound); oldest evicted first.
    max_bytes: int = attrs.field(default=256 * MiB, validator=_non_negative)
    # Seconds a retained message is kept (0: no age bound).
    max_age: float = attrs.field(default=0.0, validator=_non_negative)


# [store] writer's default (see StoreSection.writer).
WRITER_DEFAULT = "thread"


@attrs.frozen
class StoreSection:
    # The durable store (docs/store.md); off: retention in memory only and
    # nothing is reported persisted.
    enabled: bool = True
    # Directory of the store; empty: "store" beside the routing-log directory.
    dir: str = ""
    # Seconds the writer gathers routed messages into one transaction: bounds
    # what a power loss or SIGKILL can take and how late persisted
    # notifications come.  10 ms: the spec's "a few milliseconds".  In the
    # broker a commit costs about 1 ms of CPU whatever it holds (0.4-0.5 ms
    # back to back; the writer sleeps this long before each one), so 25 ms
    # saves 3-4 us of CPU per message at 10,000 msgs/s; the p99 of 25 and
    # 50 ms measured the same as 10 ms or better, within the benchmark
    # machine's noise (docs/store.md, "Choosing flush_interval").
    flush_interval: float = attrs.field(default=0.01, validator=_positive)
    # Frame bytes each HSP/Eventer bridge keeps spooled (0: no byte bound);
    # beyond it the oldest spooled messages go first, as NATS JetStream's
    # default discard policy does.  64 MiB: the buffer mirrors the spool, so
    # this is also the memory a bridge whose peer is down can hold, while the
    # default buffer (10,000 messages) of frames up to 6 KiB still fits whole.
    spool_max_bytes: int = attrs.field(default=64 * MiB, validator=_non_negative)
    # Where the SQLite writing happens: "thread" (a thread of the broker's
    # process) or "process" (a child process fed once per flush_interval;
    # broker/store/writer_process.py).  docs/store.md, "Keeping routing's
    # latency", has the measurement behind the default.
    writer: str = attrs.field(default=WRITER_DEFAULT, validator=_one_of("thread", "process"))


@attrs.frozen
class AuthSection:
    # None: true only when no [[users]] exist and every listener binds a
    # loopback address (section 7, the Mosquitto 2.x rule).
    allow_anonymous: bool | None = None
    # Anonymous clients get this user's permissions (else full rights).
    anonymous_user: str | None = None


def _group_patterns(inst: Any, attr: attrs.Attribute, value: tuple[str, ...]) -> None:
    for pattern in value:
        problem = group_pattern_problem(pattern)
        if problem is not None:
            raise ValueError(problem)


def _optional_positive(inst: Any, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError("must be greater than 0")


@attrs.frozen
class UserSection:
    """One ``[[users]]`` entry (section 7)."""

    name: str
    token: str | None = None
    token_sha256: str | None = attrs.field(default=None, validator=_hex_sha256)
    publish: tuple[str, ...] = attrs.field(default=(), validator=_group_patterns)
    subscribe: tuple[str, ...] = attrs.field(default=(), validator=_group_patterns)
    promisc: bool = False
    max_connections: int | None = attrs.field(default=None, validator=_optional_positive)


@attrs.frozen
class BridgeSection:
    protocol: str = attrs.field(validator=_one_of("hsp", "eventer", "mariner"))
    address: str
    group: str
    instance: str = "*"
    # HSP DATA Type used for messages sent to an HSP endpoint.
    type: int = attrs.field(default=1, validator=_non_negative)
    subscriptions: tuple[tuple[str, ...], ...] = ()
    token: str | None = None
    client_name: str = "skan-broker"
    # Unacknowledged messages kept for re-sending after a reconnect.
    buffer: int = attrs.field(default=10_000, validator=_positive)
    backoff_initial: float = attrs.field(default=0.5, validator=_positive)
    backoff_max: float = attrs.field(default=30.0, validator=_positive)
    tls: bool = False
    tls_ca: str | None = None
    # Client certificate (and key) presented to the peer over TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    # The [[users]] entry whose permissions this bridge has (None: full rights).
    user: str | None = None

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    def effective_subscriptions(self) -> tuple[tuple[str, ...], ...]:
        return self.subscriptions or ((self.group, "*"),)


@attrs.frozen
class ClusterSection:
    # NATS server URLs (nats://host:port), tried in order (failover); empty = no cluster.
    url: tuple[str, ...] = ()
    # Reconnect backoff towards NATS, capped exponential (as the bridges).
    backoff_initial: float = attrs.field(default=0.2, validator=_positive)
    backoff_max: float = attrs.field(default=5.0, validator=_positive)
    # Seconds a starting broker waits for an answer from another broker using
    # its server_id before it concludes the id is free.  NATS propagates
    # interest between cluster nodes within milliseconds on a LAN.
    id_probe_timeout: float = attrs.field(default=1.0, validator=_positive)
    # Seconds between the broker's heartbeats on the backplane; a broker is
    # "seen" while its last heartbeat is younger than three intervals.
    heartbeat: float = attrs.field(default=1.0, validator=_positive)
    # Bytes queued towards NATS before further messages are dropped (counted):
    # NATS unreachable or slower than the broker must never stall local routing.
    queue_limit: int = attrs.field(default=64 * MiB, validator=_positive)
    # Credentials towards NATS (its CONNECT fields): a token, or a user and
    # password; none when NATS needs none.  In this file, not in the URL, so
    # they never reach a log line or a process listing.
    token: str | None = None
    user: str | None = None
    password: str | None = None
    # TLS towards NATS: required by tls = true or a tls:// URL, and used
    # whenever the server's INFO says tls_required.  The server is verified
    # against tls_ca (the system CAs when unset); tls_cert/tls_key give a
    # client certificate to a NATS that verifies clients.
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.url)


@attrs.frozen
class Config:
    broker: BrokerSection = BrokerSection()
    skan: SkanSection = SkanSection()
    hsp: HSPSection = HSPSection()
    eventer: EventerSection = EventerSection()
    mariner: MarinerSection = MarinerSection()
    metrics: MetricsSection = MetricsSection()
    log: LogSection = LogSection()
    retention: RetentionSection = RetentionSection()
    store: StoreSection = StoreSection()
    auth: AuthSection = AuthSection()
    bridges: tuple[BridgeSection, ...] = ()
    users: tuple[UserSection, ...] = ()
    cluster: ClusterSection = ClusterSection()


_SECTIONS: dict[str, type] = {
    "broker": BrokerSection,
    "skan": SkanSection,
    "hsp": HSPSection,
    "eventer": EventerSection,
    "mariner": MarinerSection,
    "metrics": MetricsSection,
    "log": LogSection,
    "retention": RetentionSection,
    "store": StoreSection,
    "auth": AuthSection,
    "cluster": ClusterSection,
}


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert lists to tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(key, inner[0], value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, not {type(value).__name__}")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_coerce(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, not {type(value).__name__}")
        return float(value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, f"must be an integer, not {type(value).__name__}")
    if tp is not int and not isinstance(value, tp):
        raise ConfigError(key, f"must be a {tp.__name__}, not {type(value).__name__}")
    return value


def _build(cls: type, table: Any, prefix: str) -> Any:
    """One section; every refused key of it is reported (ConfigError.of), not the first."""
    if not isinstance(table, Mapping):
        raise ConfigError(prefix, "must be a table")
    hints = typing.get_type_hints(cls)
    fields = {a.name: a for a in attrs.fields(cls)}
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []
    for name, value in table.items():
        key = f"{prefix}.{name}"
        if name not in fields:
            errors.append(ConfigError(key, f"unknown key (known: {', '.join(sorted(fields))})"))
            continue
        try:
            kwargs[name] = _coerce(key, hints[name], value)
        except ConfigError as exc:
            errors.append(exc)
    for name, field in fields.items():
        if field.default is attrs.NOTHING and name not in kwargs and name not in table:
            errors.append(ConfigError(f"{prefix}.{name}", "is required"))
    # attrs validators raise ValueError(reason): run each (after its
    # converter) to name every key refused, then build the object.
    for name, value in kwargs.items():
        field = fields[name]
        if field.validator is None:
            continue
        try:
            field.validator(None, field, field.converter(value) if field.converter else value)
        except ValueError as exc:
            errors.append(ConfigError(f"{prefix}.{name}", str(exc)))
    if errors:
        raise ConfigError.of(errors)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(prefix, str(exc)) from None


def _check_bridge(key: str, bridge: BridgeSection) -> None:
    host, sep, port = bridge.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}.address", "must be 'host:port'")
    if bridge.protocol != "hsp" and any(not s for s in bridge.subscriptions):
        raise ConfigError(f"{key}.subscriptions", "an event-type pattern must not be empty")
    for pattern in bridge.subscriptions if bridge.protocol != "hsp" else ():
        problem = pattern_problem(pattern)
        if problem is not None:
            raise ConfigError(f"{key}.subscriptions", problem)
    if bridge.tls_key is not None and bridge.tls_cert is None:
        raise ConfigError(f"{key}.tls_key", "needs tls_cert (the client certificate)")
    if bridge.tls_cert is not None and not bridge.tls:
        raise ConfigError(f"{key}.tls_cert", "a client certificate needs tls = true")


def from_mapping(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from parsed TOML, refusing anything unknown or invalid.

    Every refused key of every section is reported at once (a
    :class:`ConfigError` with ``errors``); the cross-field checks of
    :func:`validate` follow once each key is valid on its own.
    """
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []

    def build(cls: type, table: Any, prefix: str) -> Any:
        try:
            return _build(cls, table, prefix)
        except ConfigError as exc:
            errors.append(exc)
            return None

    for name, value in data.items():
        if name == "bridges":
            if not isinstance(value, list):
                errors.append(ConfigError("bridges", "must be an array of tables ([[bridges]])"))
                continue
            bridges = []
            for i, table in enumerate(value):
                bridge = build(BridgeSection, table, f"bridges[{i}]")
                if bridge is None:
                    continue
                try:
                    _check_bridge(f"bridges[{i}]", bridge)
                except ConfigError as exc:
                    errors.append(exc)
                bridges.append(bridge)
            kwargs["bridges"] = tuple(bridges)
        elif name == "users":
            if not isinstance(value, list):
                errors.append(ConfigError("users", "must be an array of tables ([[users]])"))
                continue
            kwargs["users"] = tuple(
                build(UserSection, table, f"users[{i}]") for i, table in enumerate(value)
            )
        elif name in _SECTIONS:
            if name == "cluster" and isinstance(value, Mapping) and isinstance(
                value.get("url"), str
            ):
                value = {**value, "url": [value["url"]]}  # one URL or a list
            kwargs[name] = build(_SECTIONS[name], value, name)
        else:
            known = ", ".join(sorted([*_SECTIONS, "bridges", "users"]))
            errors.append(ConfigError(name, f"unknown section (known: {known})"))
    if errors:
        raise ConfigError.of(errors)
    config = Config(**kwargs)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Cross-field checks that no single section can make on its own."""
    if config.broker.queue_limit < max(config.broker.max_frame, MIN_QUEUE_LIMIT):
        raise ConfigError(
            "broker.queue_limit",
            f"must be at least broker.max_frame (one frame must fit) and {MIN_QUEUE_LIMIT} "
            "(the high-water mark plus two received chunks)",
        )
    for i, url in enumerate(config.cluster.url):
        try:
            nats_address(url)
        except ValueError as exc:
            raise ConfigError(f"cluster.url[{i}]", str(exc)) from None
    cluster = config.cluster
    if cluster.token is not None and cluster.user is not None:
        raise ConfigError("cluster.token", "a token or a user and password, not both")
    if (cluster.user is None) != (cluster.password is None):
        raise ConfigError("cluster.user", "user and password go together")
    if (cluster.tls_cert is None) != (cluster.tls_key is None):
        raise ConfigError("cluster.tls_cert", "tls_cert and tls_key go together")
    for name in ("skan", "hsp", "eventer", "mariner", "metrics"):
        section = getattr(config, name)
        if (section.tls_cert is None) != (section.tls_key is None):
            raise ConfigError(f"{name}.tls_cert", "tls_cert and tls_key go together")
        if section.tls_client_auth != "none" and section.tls_ca is None:
            raise ConfigError(f"{name}.tls_client_auth",
                              "client certificates need tls_ca (the CA that signs them)")
        if name == "metrics" and section.tls_client_auth == "optional":
            raise ConfigError("metrics.tls_client_auth",
                              "the metrics listener takes 'none' or 'require' (a required "
                              "certificate is its credential; use token or username for "
                              "clients without one)")
        if section.tls_ca is not None and section.tls_cert is None:
            raise ConfigError(f"{name}.tls_ca", "needs tls_cert and tls_key (TLS on the listener)")
    _validate_metrics_credentials(config.metrics)
    _validate_users(config)


def _validate_metrics_credentials(m: MetricsSection) -> None:
    if m.token is not None and m.token_sha256 is not None:
        raise ConfigError("metrics.token", "give token or token_sha256, not both")
    if m.token == "":
        raise ConfigError("metrics.token", "must not be empty")
    if m.password is not None and m.password_sha256 is not None:
        raise ConfigError("metrics.password", "give password or password_sha256, not both")
    has_password = m.password is not None or m.password_sha256 is not None
    if m.username is not None and not has_password:
        raise ConfigError("metrics.username", "needs password or password_sha256 (basic auth)")
    if has_password and not m.username:
        raise ConfigError("metrics.password", "needs username (basic auth)")
    if m.username is not None and ":" in m.username:
        raise ConfigError("metrics.username", "must not contain ':' (basic auth joins "
                          "user and password with it)")
    if m.password == "":
        raise ConfigError("metrics.password", "must not be empty")


def _validate_users(config: Config) -> None:
    names: set[str] = set()
    digests: dict[str, str] = {}
    for i, user in enumerate(config.users):
        key = f"users[{i}]"
        if not user.name:
            raise ConfigError(f"{key}.name", "must not be empty")
        if user.name in names:
            raise ConfigError(f"{key}.name", f"user {user.name!r} is defined twice")
        names.add(user.name)
        if user.token is not None and user.token_sha256 is not None:
            raise ConfigError(f"{key}.token", "give token or token_sha256, not both")
        if user.token == "":
            raise ConfigError(f"{key}.token", "must not be empty")
        digest = (hash_token(user.token) if user.token is not None
                  else (user.token_sha256 or "").lower() or None)
        if digest is not None:
            if digest in digests:
                # A token must name exactly one user.
                raise ConfigError(f"{key}.token", f"the same token as user {digests[digest]!r}")
            digests[digest] = user.name
    anon = config.auth.anonymous_user
    if anon is not None and anon not in names:
        raise ConfigError("auth.anonymous_user", f"{anon!r} is not the name of a [[users]] entry")
    for listener in AUTH_LISTENERS:
        anon = getattr(config, listener).anonymous_user
        if anon is not None and anon not in names:
            raise ConfigError(f"{listener}.anonymous_user",
                              f"{anon!r} is not the name of a [[users]] entry")
    for i, bridge in enumerate(config.bridges):
        if bridge.user is not None and bridge.user not in names:
            raise ConfigError(f"bridges[{i}].user",
                              f"{bridge.user!r} is not the name of a [[users]] entry")


# Listeners whose clients authenticate (section 7); the metrics endpoint
# serves read-only figures and is not one of them.
AUTH_LISTENERS = ("skan", "hsp", "eventer", "mariner")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, assume reachable


def anonymous_allowed(config: Config) -> bool:
    """Section 7: explicit ``allow_anonymous``, else true only with no users
    on loopback listeners."""
    if config.auth.allow_anonymous is not None:
        return config.auth.allow_anonymous
    return not config.users and is_loopback(config.broker.host)


def check_exposure(config: Config) -> None:
    """Refuse to start (the Mosquitto 2.x rule): a non-loopback listener with
    no users needs an explicit ``allow_anonymous = true``.

    Checked at start-up after flags override the file (``--host``), and on reload.
    """
    host = config.broker.host
    if config.users or config.auth.allow_anonymous is True or is_loopback(host):
        return
    raise ConfigError(
        "auth.allow_anonymous",
        f"the listeners bind {host!r}, which is not a loopback address, and no [[users]] "
        "are configured: anyone who can reach this machine could read and write every "
        "group.  Add [[users]] (see docs/security.md) or set allow_anonymous = true in "
        "[auth] to accept that",
    )


def build_authenticator(config: Config) -> Authenticator:
    """The router's :class:`Authenticator` for a validated configuration."""
    return Authenticator.from_specs(
        config.users,
        allow_anonymous=anonymous_allowed(config),
        anonymous_user=config.auth.anonymous_user,
        listener_tokens={"eventer": config.eventer.token, "mariner": config.mariner.token},
        listener_anonymous={name: getattr(config, name).anonymous_user
                            for name in AUTH_LISTENERS},
    )


def nats_address(url: str) -> tuple[str, int]:
    """``nats://host:port``, ``tls://host:port`` or ``host:port`` (port 4222 by
    default) -> (host, port).  Credentials go in [cluster], not in the URL."""
    rest = url.removeprefix("nats://").removeprefix("tls://")
    if "@" in rest:
        # The URL is not repeated: it holds a secret.
        raise ValueError("credentials in a NATS URL are not read: put them in [cluster] "
                         "token or user and password")
    if "://" in rest or "/" in rest:
        raise ValueError(f"{url!r} is not nats://host:port or tls://host:port")
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = rest, "4222"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{url!r} is not nats://host:port")
    return host.strip("[]"), int(port)


def load(path: str | None) -> Config:
    """Load a TOML file (or the embedded defaults when ``path`` is None)."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}",
                          text=f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        # The file's own TOML error (it says the line and column).
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}",
                          text=f"{path}: not valid TOML: {exc}") from None
    return from_mapping(data)


def override(config: Config, **flags: Any) -> Config:
    """Apply command-line flags (None means "not given") on top of a config."""
    mapping = {
        "host": ("broker", "host"),
        "server_id": ("broker", "server_id"),
        "skan_port": ("skan", "port"),
        "hsp_port": ("hsp", "port"),
        "eventer_port": ("eventer", "port"),
        "mariner_port": ("mariner", "port"),
        "metrics_port": ("metrics", "port"),
        "log_dir": ("log", "dir"),
        "store_dir": ("store", "dir"),
        "store_writer": ("store", "writer"),
        "log_level": ("broker", "log_level"),
        "log_format": ("broker", "log_format"),
        "cluster": ("cluster", "url"),
        "reuse_port": ("broker", "reuse_port"),
    }
    for flag, value in flags.items():
        if value is None:
            continue
        section_name, key = mapping[flag]
        section = getattr(config, section_name)
        try:
            section = attrs.evolve(section, **{key: value})
        except ValueError as exc:
            raise ConfigError(f"--{flag.replace('_', '-')}", str(exc)) from None
        config = attrs.evolve(config, **{section_name: section})
    validate(config)
    return config
