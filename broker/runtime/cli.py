"""``skan-broker`` / ``python -m broker``: configuration file plus overriding flags."""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

import trio

from broker.cluster.service import ClusterStartError
from broker.core.auth import hash_token
from broker.runtime import app, config, workers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="skan-broker",
        description="Skan message-routing broker (Skan, HSP, Chatter/Eventer, Mariner).  "
        "'skan-broker hash-token' reads a token on stdin and prints its token_sha256.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--host", help="address every listener binds (default 127.0.0.1)")
    p.add_argument("--skan-port", type=int, help="native Skan port (default 9912, 0 = free port)")
    p.add_argument("--hsp-port", type=int, help="HSP port (default 9913)")
    p.add_argument("--eventer-port", type=int, help="Chatter/Eventer port (default 23012)")
    p.add_argument("--mariner-port", type=int, help="Mariner port (default 23014)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9914)")
    p.add_argument("--log-dir", help="routing-log directory (default var/routing-log)")
    p.add_argument("--server-id", type=int, help="Hat server id used in EventIds (default 1)")
    p.add_argument("--cluster", metavar="URL", action="append",
                   help="NATS server of the cluster backplane (repeat for failover)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="run N broker processes sharing the ports (needs --cluster)")
    p.add_argument("--reuse-port", action="store_true", default=None,
                   help=argparse.SUPPRESS)  # set on each worker by --workers
    p.add_argument("--log-level", default="INFO", help="diagnostic log level (default INFO)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> config.Config:
    cfg = config.load(args.config)
    return config.override(
        cfg,
        host=args.host,
        server_id=args.server_id,
        cluster=tuple(args.cluster) if args.cluster else None,
        skan_port=args.skan_port,
        hsp_port=args.hsp_port,
        eventer_port=args.eventer_port,
        mariner_port=args.mariner_port,
        metrics_port=args.metrics_port,
        log_dir=args.log_dir,
        reuse_port=args.reuse_port,
    )


def hash_token_main() -> int:
    """``skan-broker hash-token``: read a token on stdin, print its ``token_sha256``."""
    token = sys.stdin.readline().rstrip("\r\n")
    if not token:
        print("skan-broker hash-token: no token on standard input", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["hash-token"]:
        return hash_token_main()
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = build_config(args)
        config.check_exposure(cfg)
    except config.ConfigError as exc:
        print(f"skan-broker: {exc}", file=sys.stderr)
        return 2
    if args.workers is not None:
        if args.workers < 1:
            print("skan-broker: --workers must be at least 1", file=sys.stderr)
            return 2
        if not cfg.cluster.enabled:
            print("skan-broker: --workers needs a cluster backplane to route between the "
                  "workers (--cluster URL or [cluster] url)", file=sys.stderr)
            return 2
        return workers.run_workers(cfg, _without_workers(sys.argv[1:] if argv is None else argv),
                                   args.workers)
    try:
        trio.run(partial(app.run, cfg, reload=partial(build_config, args)))
    except (OSError, ClusterStartError, BaseExceptionGroup) as exc:
        os_error = _find(exc, OSError) or _find(exc, ClusterStartError)
        if os_error is None:
            raise
        print(f"skan-broker: cannot start: {os_error}", file=sys.stderr)
        return 1
    return 0


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


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` inside a (possibly nested) exception group."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find(inner, kind)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
