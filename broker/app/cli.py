"""``skan-broker`` / ``python -m broker``: configuration file plus overriding flags.

Exit codes: 0 after a graceful stop (or a valid ``--check-config``), 1 when
start-up fails (a port in use, a TLS file missing: the line names the
listener, host:port or file), 2 for a bad command line or configuration,
130 when interrupted before the listeners are up.

``skan-broker accept-store DIR`` takes a store that was refused for a
missing file as it is (broker/store/db.py ``accept_store``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from functools import partial

import attrs
import trio

from broker.app import lifecycle as app
from broker.app import workers
from broker.cluster.cluster_service import ClusterStartError
from broker.core.auth import hash_token
from broker.serving import config
from broker.serving.hostloop import HostLoop
from broker.store.db import accept_store
from toolkit import cliutil

PROG = "skan-broker"


def _default(section: type, key: str) -> object:
    """A key's default, read from its config class: help text never repeats a literal."""
    return attrs.fields_dict(section)[key].default


def build_parser() -> cliutil.Parser:
    p = cliutil.Parser(
        prog=PROG,
        usage=f"{PROG} [--config FILE] [options]\n"
              f"       {PROG} --check-config FILE\n"
              f"       {PROG} hash-token < TOKEN   (prints the token's token_sha256)",
        description="Skan message-routing broker (Skan, HSP, Chatter/Eventer, Mariner). "
                    "Flags override the configuration file; defaults are the embedded "
                    "configuration's. 'skan-broker hash-token' reads a token on stdin and "
                    "prints its token_sha256. 'skan-broker accept-store DIR' takes a store "
                    "refused for a missing file as it is (docs/store.md).",
    )
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--check-config", metavar="FILE",
                   help="check FILE (keys, values, TLS files) and exit: 0 valid, 2 invalid; "
                        "never listens")
    B, L = config.BrokerSection, config.LogSection

    def port_help(name: str, section: type) -> str:
        return f"{name} port (default: {_default(section, 'port')}; 0 picks a free port)"

    p.add_argument("--host", type=str,
                   help=f"address every listener binds (default: {_default(B, 'host')})")
    p.add_argument("--skan-port", type=cliutil.port,
                   help=port_help("native Skan", config.SkanSection))
    p.add_argument("--hsp-port", type=cliutil.port, help=port_help("HSP", config.HSPSection))
    p.add_argument("--eventer-port", type=cliutil.port,
                   help=port_help("Chatter/Eventer", config.EventerSection))
    p.add_argument("--mariner-port", type=cliutil.port,
                   help=port_help("Mariner", config.MarinerSection))
    p.add_argument("--metrics-port", type=cliutil.port,
                   help=port_help("Prometheus /metrics", config.MetricsSection))
    p.add_argument("--log-dir", metavar="DIR",
                   help=f"routing-log directory (default: {_default(L, 'dir')})")
    p.add_argument("--store-dir", metavar="DIR",
                   help="durable store directory (default: \"store\" beside the routing-log "
                        "directory)")
    p.add_argument("--store-writer", choices=("thread", "process"),
                   help="where the durable store's SQLite writing runs: a thread of the "
                        "broker or a child process (default: [store] writer)")
    p.add_argument("--server-id", type=cliutil.non_negative_int,
                   help=f"Hat server id used in EventIds (default: {_default(B, 'server_id')})")
    p.add_argument("--cluster", metavar="URL", action="append",
                   help="NATS server of the cluster backplane (repeat for failover)")
    p.add_argument("--workers", type=cliutil.non_negative_int, metavar="N",
                   help="run N broker processes sharing the ports (needs --cluster)")
    p.add_argument("--reuse-port", action="store_true", default=None,
                   help=argparse.SUPPRESS)  # set on each worker by --workers
    p.add_argument("--log-level", type=str.lower, choices=config.LOG_LEVELS,
                   help="diagnostic log level on stderr, in any case (default: [broker] "
                        f"log_level, {_default(B, 'log_level')})")
    p.add_argument("--log-format", choices=config.LOG_FORMATS,
                   help="diagnostics as text lines or JSON objects (default: [broker] "
                        f"log_format, {_default(B, 'log_format')})")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# The flags that override a configuration key (config.override names each one's key),
# in the order they are applied.
CONFIG_FLAGS = ("host", "server_id", "cluster", "skan_port", "hsp_port", "eventer_port",
                "mariner_port", "metrics_port", "log_dir", "store_dir", "store_writer",
                "log_level", "log_format", "reuse_port")


def build_config(args: argparse.Namespace) -> config.Config:
    flags = {name: getattr(args, name) for name in CONFIG_FLAGS}
    flags["cluster"] = tuple(args.cluster) if args.cluster else None
    return config.override(config.load(args.config), **flags)


# ---- diagnostics ----------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message[, exception]."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


# ---- checks -----------------------------------------------------------------------------

LISTENERS = ("skan", "hsp", "eventer", "mariner", "metrics")


def check_files(cfg: config.Config) -> None:
    """Files the configuration names must be readable: refused now, not at the first client."""
    for name in LISTENERS:
        section = getattr(cfg, name)
        if not getattr(section, "enabled", True):
            continue
        for key in ("tls_cert", "tls_key"):
            path = getattr(section, key)
            if path is not None and not os.access(path, os.R_OK):
                reason = "no such file" if not os.path.exists(path) else "not readable"
                raise config.ConfigError(f"{name}.{key}", f"{path}: {reason}")
    for i, bridge in enumerate(cfg.bridges):
        if bridge.tls_ca is not None and not os.access(bridge.tls_ca, os.R_OK):
            raise config.ConfigError(f"bridges[{i}].tls_ca", f"{bridge.tls_ca}: cannot read")


def check_config(path: str) -> int:
    try:
        cfg = config.load(path)
        check_files(cfg)
        config.check_exposure(cfg)
    except config.ConfigError as exc:
        print(f"{PROG}: {config_problem(exc, path)}", file=sys.stderr)
        return cliutil.EXIT_USAGE
    listeners = [name for name in LISTENERS if getattr(getattr(cfg, name), "enabled", True)]
    print(f"{path}: valid ({', '.join(listeners)}; {len(cfg.bridges)} bridge(s); "
          f"routing log {'in ' + cfg.log.dir if cfg.log.enabled else 'off'})")
    return cliutil.EXIT_OK


def config_problem(exc: config.ConfigError, path: str | None) -> str:
    """The line(s) for a refused configuration, naming the file it came from.

    Errors of a flag (``--skan-port``) or of reading the file (which name it
    themselves) are not prefixed.
    """
    if path is None or exc.key.startswith("--"):
        return str(exc)
    return f"{path}: {exc}"


def hash_token_main() -> int:
    """``skan-broker hash-token``: read a token on stdin, print its ``token_sha256``."""
    token = sys.stdin.readline().rstrip("\r\n")
    if not token:
        print("skan-broker hash-token: no token on standard input", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def accept_store_main(args: list[str]) -> int:
    """``skan-broker accept-store DIR``: the operator takes a refused store as it is.

    For a store refused because a file is missing or older than its state
    file (docs/store.md, "A store missing a file"); the broker must be stopped.
    """
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: {PROG} accept-store DIR  (the [store] dir; the broker must be stopped)",
              file=sys.stderr)
        return cliutil.EXIT_USAGE
    try:
        print(accept_store(args[0]))
    except OSError as exc:
        print(f"{PROG}: accept-store: {cliutil.describe_os_error(exc)}", file=sys.stderr)
        return cliutil.EXIT_FAILURE
    return cliutil.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command == ["hash-token"]:
        return hash_token_main()
    if command == ["accept-store"]:
        return accept_store_main((sys.argv[1:] if argv is None else argv)[1:])
    args = parse_args(argv)
    if args.check_config is not None:
        return check_config(args.check_config)
    try:
        cfg = build_config(args)
        check_files(cfg)
        config.check_exposure(cfg)
    except config.ConfigError as exc:
        print(f"{PROG}: {config_problem(exc, args.config)}", file=sys.stderr)
        return cliutil.EXIT_USAGE
    setup_logging(cfg.broker.log_level, cfg.broker.log_format)
    if args.workers is not None:
        if args.workers < 1:
            print(f"{PROG}: --workers must be at least 1", file=sys.stderr)
            return cliutil.EXIT_USAGE
        if not cfg.cluster.enabled:
            print(f"{PROG}: --workers needs a cluster backplane to route between the "
                  "workers (--cluster URL or [cluster] url)", file=sys.stderr)
            return cliutil.EXIT_USAGE
        return workers.run_workers(cfg, _without_workers(sys.argv[1:] if argv is None else argv),
                                   args.workers)
    try:
        run = partial(app.run, cfg, reload=partial(build_config, args))
        if cfg.broker.host_loop:
            HostLoop().run(run)
        else:
            trio.run(run)
    except BaseException as exc:
        return cliutil.report(PROG, exc, errors=_startup_error)
    return cliutil.EXIT_OK


def _without_workers(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def _startup_error(exc: BaseException) -> str | None:
    if isinstance(exc, app.StartupError):
        return str(exc)
    if isinstance(exc, ClusterStartError):
        return f"cannot start: {exc}"
    if isinstance(exc, OSError):
        return f"cannot start: {cliutil.describe_os_error(exc)}"
    return None


if __name__ == "__main__":
    sys.exit(main())
