"""``skan``: publish, subscribe, request and read stats from the command line.

    skan sub chat                      # print every message on group "chat"
    skan pub chat "hello"              # send a DATA message
    skan pub chat '{"n": 1}' --json    # send a JSON value as a Skan HASH
    skan request svc '{"q": 1}' --json --to LNAME
    skan stats
    skan --protocol hsp sub chat       # the same over the broker's HSP listener
    skan --protocol hsp pub chat hi --acked   # DATA_ACK: wait for the broker's ACK
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import trio

from broker.core.events import MappingError, json_to_skan
from clients.common import env_token
from clients.hsp import DEFAULT_PORT as HSP_PORT
from clients.hsp import HSPError, SkanOverHSP
from clients.skan import (
    DEFAULT_PORT,
    Message,
    SkanClient,
    SkanClientError,
    ssl_client_context,
    strkeys,
)


def _payload(text: str | None, as_json: bool) -> Any:
    if text is None:
        return None
    if not as_json:
        return text
    try:
        return json_to_skan(json.loads(text))
    except (json.JSONDecodeError, MappingError) as exc:
        raise SystemExit(f"skan: bad --json message: {exc}") from None


def _show(value: Any) -> str:
    value = strkeys(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return "0x" + value.hex()
    return json.dumps(value, ensure_ascii=False, default=lambda b: "0x" + b.hex())


def format_message(m: Message, as_json: bool = False) -> str:
    if as_json:
        return json.dumps({
            "group": m.group, "instance": m.instance, "from": m.sender, "to": m.to,
            "seq": m.seq, "repl": m.repl, "msg": strkeys(m.msg),
        }, ensure_ascii=False, default=lambda b: "0x" + b.hex())
    repl = f" repl={m.repl}" if m.repl else ""
    return f"[{m.group}/{m.instance}] {m.sender} -> {m.to} seq={m.seq}{repl}: {_show(m.msg)}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="skan", description="Talk to a Skan broker.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--protocol", choices=["skan", "hsp"], default="skan",
                   help="native Skan, or Skan messages carried over HSP")
    p.add_argument("--port", type=int,
                   help=f"broker port (default {DEFAULT_PORT}, or {HSP_PORT} with --protocol hsp)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca", help="CA file to verify the broker's certificate")
    p.add_argument("--insecure", action="store_true", help="TLS without certificate checks")
    p.add_argument("--cert", help="client certificate (PEM) to present; implies --tls")
    p.add_argument("--key", help="private key of --cert (if not in the same file)")
    p.add_argument("--token", help="credential sent in getlname "
                   "(default: the SKAN_TOKEN environment variable)")
    sub = p.add_subparsers(dest="command", required=True)

    pub = sub.add_parser("pub", help="send a message to a group")
    pub.add_argument("group")
    pub.add_argument("message", nargs="?", help="DATA text (or JSON with --json); none = NULL")
    pub.add_argument("--instance", default="*")
    pub.add_argument("--to", default="*", help="an lname for a directed message")
    pub.add_argument("--json", action="store_true", help="message is JSON, sent as HASH/LIST")
    pub.add_argument("--count", type=int, default=1, help="send it this many times")
    pub.add_argument("--acked", action="store_true",
                     help="(--protocol hsp) send as DATA_ACK and wait for each ACK")

    s = sub.add_parser("sub", help="print messages of a group")
    s.add_argument("group")
    s.add_argument("--instance", default="*")
    s.add_argument("--subtype", default="normal", choices=["normal", "meonly", "promisc"])
    s.add_argument("--count", type=int, default=0, help="exit after this many (0 = never)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")

    r = sub.add_parser("request", help="send and wait for the reply")
    r.add_argument("group")
    r.add_argument("message", nargs="?")
    r.add_argument("--to", default="*")
    r.add_argument("--instance", default="*")
    r.add_argument("--json", action="store_true")
    r.add_argument("--timeout", type=float, default=5.0)

    sub.add_parser("stats", help="print the broker's counters")
    args = p.parse_args(argv)
    args.token = env_token(args.token)
    if args.port is None:
        args.port = HSP_PORT if args.protocol == "hsp" else DEFAULT_PORT
    args.tls = args.tls or args.cert is not None
    if getattr(args, "acked", False) and args.protocol != "hsp":
        p.error("--acked needs --protocol hsp")
    return args


def _connect(args: argparse.Namespace, ctx: Any):
    if args.protocol == "hsp":
        return SkanOverHSP.connect(args.host, args.port, ssl_context=ctx, token=args.token,
                                   acked=getattr(args, "acked", False))
    return SkanClient.connect(args.host, args.port, ssl_context=ctx, token=args.token)


async def run(args: argparse.Namespace, out=sys.stdout) -> int:
    ctx = ssl_client_context(args.ca, args.insecure, args.cert, args.key) if args.tls else None
    async with _connect(args, ctx) as client:
        if args.command == "pub":
            msg = _payload(args.message, args.json)
            for _ in range(args.count):
                try:
                    await client.send(args.group, msg, instance=args.instance, to=args.to)
                except HSPError as exc:
                    print(f"skan: broker refused: {exc}", file=sys.stderr)
                    return 1
            await client.barrier()
            for err in client.errors:
                print(f"skan: broker refused: {err.reason}", file=sys.stderr)
            return 1 if client.errors else 0
        if args.command == "sub":
            await client.subscribe(args.group, args.instance, args.subtype)
            print(f"# subscribed to {args.group}/{args.instance} as {client.lname}",
                  file=sys.stderr, flush=True)
            n = 0
            async for m in client:
                print(format_message(m, args.json), file=out, flush=True)
                n += 1
                if args.count and n >= args.count:
                    break
            return 0
        if args.command == "request":
            msg = _payload(args.message, args.json)
            try:
                reply = await client.request(args.group, msg, to=args.to,
                                             instance=args.instance, timeout=args.timeout)
            except SkanClientError as exc:
                print(f"skan: broker refused: {exc.reason}", file=sys.stderr)
                return 1
            except trio.TooSlowError:
                print(f"skan: no reply within {args.timeout}s", file=sys.stderr)
                return 1
            print(format_message(reply, args.json), file=out)
            return 0
        stats = await client.stats()
        width = max(map(len, stats))
        for key, value in stats.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            print(f"{key:<{width}}  {value}", file=out)
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return trio.run(run, args)
    except OSError as exc:
        print(f"skan: cannot reach the broker at {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except SkanClientError as exc:  # a refused credential: the broker says why
        print(f"skan: broker refused: {exc.reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
