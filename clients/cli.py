"""``skan``: publish, subscribe, request, reply and read stats from the command line.

    skan sub chat                      # print every message on group "chat"
    skan pub chat "hello"              # send a DATA message
    skan pub chat '{"n": 1}' --json    # send a JSON value as a Skan HASH
    skan pub plant --instance pump1 --event-json '{"on": true, "value": 1234}'
                                       # a Hat JSON payload, typed for Eventer/Mariner
    skan reply svc --text pong         # answer every request sent to group "svc"
    skan request svc '{"q": 1}' --json # send and wait for the reply
    skan stats
    skan --protocol hsp sub chat       # the same over the broker's HSP listener
    skan --protocol hsp pub chat hi --acked   # DATA_ACK: wait for the broker's ACK
    skan connections --sort queue      # who is connected, the fullest queue first
    skan subscriptions --group chat    # who subscribes what
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import trio

from clients import monitor
from clients.hsp import DEFAULT_PORT as HSP_PORT
from clients.hsp import HSPClosed, HSPError, SkanOverHSP
from clients.skan import (
    CLOSED,
    DEFAULT_PORT,
    Message,
    SkanClient,
    SkanClientError,
    SkanClosed,
    event_json_send,
    strkeys,
)
from toolkit import cliutil
from toolkit.streams import CONNECT_TIMEOUT
from wire.errors import ProtocolError
from wire.skan.eventjson import loads_exact
from wire.skan.jsonvalue import JsonValueError

PROG = "skan"
# Seconds `skan request` waits for its reply unless told otherwise.
REQUEST_TIMEOUT = 5.0

NUMBERS_NOTE = ('Skan has no number type: numbers travel as decimal strings '
                '(1 is sent and shown as "1").')
EVENT_JSON_NOTE = ('With --event-json the exact JSON also travels in the routing tag '
                   'payload-json, so Hat (Eventer, Mariner) consumers get its numbers and '
                   'booleans with their types.')


def _show(value: Any) -> str:
    value = strkeys(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return "0x" + value.hex()
    return json.dumps(value, ensure_ascii=False, default=lambda b: "0x" + b.hex())


def format_message(m: Message, as_json: bool = False) -> str:
    """One line per message: text payloads as text, HASH/LIST as JSON, binary as 0x-hex;
    a ``payload-json`` tag (the exact Hat JSON payload) follows as ``payload-json=TEXT``
    (with --json: ``"payload_json": VALUE``)."""
    exact = m.event_json_text
    if as_json:
        fields = {
            "group": m.group, "instance": m.instance, "from": m.sender, "to": m.to,
            "seq": m.seq, "repl": m.repl, "msg": strkeys(m.msg),
        }
        if exact is not None:
            value = m.event_json
            fields["payload_json"] = exact if value is None and exact != "null" else value
        return json.dumps(fields, ensure_ascii=False, default=lambda b: "0x" + b.hex())
    repl = f" repl={m.repl}" if m.repl else ""
    tail = "" if exact is None else f" payload-json={exact}"
    return (f"[{m.group}/{m.instance}] {m.sender} -> {m.to} seq={m.seq}{repl}: "
            f"{_show(m.msg)}{tail}")


def build_parser() -> cliutil.Parser:
    examples = __doc__.split("\n\n")[1].rstrip()
    p = cliutil.Parser(prog=PROG, description="Talk to a Skan broker. " + NUMBERS_NOTE,
                       epilog="examples:\n" + examples)
    p.add_argument("--protocol", choices=["skan", "hsp"], default="skan",
                   help="native Skan, or Skan messages carried over HSP")
    cliutil.add_connection_options(
        p, default_port=None,
        port_help=f"broker port (default: {DEFAULT_PORT}, or {HSP_PORT} with --protocol hsp)")
    p.add_argument("--connect-timeout", type=cliutil.positive_float, default=CONNECT_TIMEOUT,
                   metavar="SECONDS",
                   help="seconds to connect and get the broker's first answer")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pub = sub.add_parser("pub", help="send a message to a group",
                         description="Send a message to a group. " + NUMBERS_NOTE + " "
                                     + EVENT_JSON_NOTE)
    pub.add_argument("group", help="group to send to")
    pub.add_argument("message", nargs="?",
                     help="DATA text (JSON with --json or --event-json); none sends NULL")
    pub.add_argument("--instance", default="*", help="instance within the group")
    pub.add_argument("--to", default="*", help="an lname for a directed message, * for all")
    kind = pub.add_mutually_exclusive_group()
    kind.add_argument("--json", action="store_true",
                      help="the message is JSON, sent as HASH/LIST/DATA")
    kind.add_argument("--event-json", action="store_true",
                      help="the message is a Hat JSON payload: sent as with --json, plus the "
                           "exact JSON in the routing tag payload-json (Hat consumers get "
                           "its types)")
    pub.add_argument("--count", type=cliutil.positive_int, default=1,
                     help="send it this many times")
    pub.add_argument("--acked", action="store_true",
                     help="(--protocol hsp) send as DATA_ACK and wait for each ACK")

    s = sub.add_parser("sub", help="print messages of a group",
                       description="Print every message of a group, one per line: text as "
                                   "text, HASH/LIST as JSON, binary DATA as 0x-hex. "
                                   + NUMBERS_NOTE)
    s.add_argument("group", help="group to subscribe to")
    s.add_argument("--instance", default="*", help="instance within the group (* = all)")
    s.add_argument("--subtype", default="normal", choices=["normal", "meonly", "promisc"],
                   help="normal: broadcasts and messages to me; meonly: only to me; "
                        "promisc: everything on the group")
    s.add_argument("--count", type=cliutil.non_negative_int, default=0,
                   help="exit after this many messages (0 = never)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")

    r = sub.add_parser("request", help="send a message and wait for its reply",
                       description="Send a message and print the first reply whose repl is "
                                   "its seq (answer it with `skan reply`).")
    r.add_argument("group", help="group of the responder")
    r.add_argument("message", nargs="?", help="DATA text (JSON with --json); none sends NULL")
    r.add_argument("--to", default="*", help="the responder's lname, or * for any")
    r.add_argument("--instance", default="*", help="instance within the group")
    r.add_argument("--json", action="store_true",
                   help="the message is JSON; the reply is printed as JSON too")
    r.add_argument("--timeout", type=cliutil.positive_float, default=REQUEST_TIMEOUT,
                   metavar="SECONDS", help="seconds to wait for the reply")

    rp = sub.add_parser(
        "reply", help="answer requests sent to a group",
        description="Subscribe to a group and answer every request sent to it (broadcast to "
                    "the group or addressed to this lname) with a reply to its sender. The "
                    "lname is printed on stderr. Messages that are themselves replies are not "
                    "answered.")
    rp.add_argument("group", help="group whose requests to answer")
    rp.add_argument("--instance", default="*", help="instance within the group (* = all)")
    what = rp.add_mutually_exclusive_group()
    what.add_argument("--text", help="answer every request with this (JSON with --json)")
    what.add_argument("--echo", action="store_true",
                      help="answer with the request's own message (what happens without --text)")
    rp.add_argument("--json", action="store_true", help="--text is JSON, sent as HASH/LIST")
    rp.add_argument("--count", type=cliutil.non_negative_int, default=0,
                    help="exit after answering this many requests (0 = never)")

    sub.add_parser("stats", help="print the broker's counters",
                   description="Print the broker's counters (the Skan stats message).")
    _add_listing_parsers(sub)
    return p


# Default of --metrics-port: the broker's default [metrics] port.
METRICS_PORT = 9914
CONNECTION_SORTS = ("since", "lname", "queue", "queue_frames", "msgs_out", "msgs_in",
                    "bytes_out", "bytes_in", "dropped", "subscriptions")


# Rows per listing reply the broker allows (broker/observability/listing.py MAX_LIMIT).
MAX_LISTING_LIMIT = 1000


def _listing_limit(text: str) -> int:
    value = cliutil.positive_int(text)
    if value > MAX_LISTING_LIMIT:
        raise argparse.ArgumentTypeError(f"at most {MAX_LISTING_LIMIT}, not {value} "
                                         "(page with --offset)")
    return value


def _add_listing_parsers(sub: Any) -> None:
    """`skan connections` and `skan subscriptions`: the metrics listener's listing over HTTP."""

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--metrics-port", type=cliutil.port, default=METRICS_PORT,
                       help="the broker's metrics port ([metrics] port); --host, --tls, "
                            "--tls-ca and --insecure apply to it")
        q.add_argument("--metrics-token", metavar="TOKEN",
                       help="[metrics] token, sent as 'Authorization: Bearer' (default: the "
                            "SKAN_METRICS_TOKEN environment variable)")
        q.add_argument("--metrics-user", metavar="USER:PASSWORD",
                       help="[metrics] username and password, sent as basic auth (default: "
                            "the SKAN_METRICS_USER environment variable)")
        q.add_argument("--proto", metavar="PROTOCOL",
                       help="only this protocol (skan, hsp, eventer, mariner, bridge-...)")
        q.add_argument("--user", help="only connections of this [[users]] name")
        q.add_argument("--group", help="only subscriptions that may take this group's messages")
        q.add_argument("--lname", help="only this connection")
        q.add_argument("--limit", type=_listing_limit, default=50,
                       help="rows to show, at most 1000 (the broker's cap)")
        q.add_argument("--offset", type=cliutil.non_negative_int, default=0,
                       help="rows to skip (paging)")
        q.add_argument("--order", choices=["asc", "desc"],
                       help="sort order (default: the key's own: oldest first, largest first)")
        q.add_argument("--json", action="store_true", help="print the broker's JSON as is")

    c = sub.add_parser(
        "connections", help="list connections (the metrics listener's /connections)",
        description="List who is connected: lname, protocol, user, remote address, uptime, "
                    "subscriptions, outgoing queue (frames, bytes), messages and bytes in and "
                    "out, drops. Read over HTTP from the broker's metrics port.")
    common(c)
    c.add_argument("--sort", choices=CONNECTION_SORTS, default="since",
                   help="queue: the slow consumer first; msgs_out: the busiest receiver first")
    c.add_argument("--subs", action="store_true",
                   help="list each connection's subscriptions under it")
    s = sub.add_parser(
        "subscriptions", help="list subscriptions (the metrics listener's /subscriptions)",
        description="List subscriptions: group and instance (or Hat pattern), subtype and "
                    "the connection holding it. Read over HTTP from the broker's metrics port.")
    common(s)
    s.add_argument("--sort", choices=["group", "lname"], default="group", help="sort key")


async def _listing(args: argparse.Namespace) -> int:
    token = args.metrics_token or os.environ.get("SKAN_METRICS_TOKEN")
    user = args.metrics_user or os.environ.get("SKAN_METRICS_USER")
    params: dict[str, Any] = {
        "offset": args.offset or None, "limit": args.limit, "sort": args.sort,
        "order": args.order, "protocol": args.proto, "user": args.user, "group": args.group,
        "lname": args.lname,
    }
    if args.command == "connections" and args.subs:
        params["subs"] = 1
    data = await monitor.fetch_listing(
        args.host, args.metrics_port, f"/{args.command}", params,
        auth=monitor.authorization(token, user), ssl_context=cliutil.client_ssl_context(args),
        timeout=args.connect_timeout)
    if args.json:
        cliutil.out(json.dumps(data, indent=1, ensure_ascii=False))
    elif args.command == "connections":
        for line in monitor.connection_lines(data, args.subs):
            cliutil.out(line)
    else:
        for line in monitor.subscription_lines(data):
            cliutil.out(line)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    cliutil.finish_connection_args(args)
    if args.port is None:
        args.port = HSP_PORT if args.protocol == "hsp" else DEFAULT_PORT
    if getattr(args, "acked", False) and args.protocol != "hsp":
        p.error("--acked needs --protocol hsp")
    # Check the payload now: a bad --json is a usage error, whether or not a broker runs.
    args.tags = None
    if getattr(args, "event_json", False):
        if args.message is None:
            p.error("--event-json needs the JSON text (the message argument)")
        try:
            # Parsed within the broker's limits, so what it would refuse is refused here.
            args.message, args.tags = event_json_send(loads_exact(args.message.encode()))
        except (ProtocolError, JsonValueError) as exc:
            p.error(f"argument message: {exc}")
    text_field = "text" if args.command == "reply" else "message"
    if getattr(args, "json", False) and args.command in ("pub", "request", "reply"):
        raw = getattr(args, text_field)
        if raw is not None:
            try:
                setattr(args, text_field, cliutil.skan_json(raw))
            except argparse.ArgumentTypeError as exc:
                p.error(f"argument {text_field}: {exc}")
    return args


def _connect(args: argparse.Namespace):
    ctx = cliutil.client_ssl_context(args)
    if args.protocol == "hsp":
        return SkanOverHSP.connect(args.host, args.port, ssl_context=ctx, token=args.token,
                                   connect_timeout=args.connect_timeout,
                                   timeout=args.connect_timeout,
                                   acked=getattr(args, "acked", False))
    return SkanClient.connect(args.host, args.port, ssl_context=ctx, token=args.token,
                              connect_timeout=args.connect_timeout, timeout=args.connect_timeout)


def _ended(client: SkanClient) -> int:
    """A subscriber's stream ended before --count: say why, exit 1."""
    raise SkanClosed(client.close_reason or CLOSED)


async def _pub(client: SkanClient, args: argparse.Namespace) -> int:
    for _ in range(args.count):
        await client.send(args.group, args.message, instance=args.instance, to=args.to,
                          tags=args.tags)
    await client.barrier()
    for err in client.errors:
        print(f"{PROG}: broker refused: {err.reason}", file=sys.stderr)
    return 1 if client.errors else 0


async def _sub(client: SkanClient, args: argparse.Namespace) -> int:
    await client.subscribe(args.group, args.instance, args.subtype)
    cliutil.note(f"subscribed to {args.group}/{args.instance} as {client.lname} "
                 "(numbers arrive as decimal strings)")
    n = 0
    async for m in client:
        cliutil.out(format_message(m, args.json))
        n += 1
        if args.count and n >= args.count:
            return 0
    return _ended(client)


async def _request(client: SkanClient, args: argparse.Namespace) -> int:
    directed = args.to != "*"
    # A directed request to an lname nobody has is undeliverable, which the
    # broker counts: compare its counter around the send to say so.
    before = await _undeliverable(client) if directed else None
    try:
        reply = await client.request(args.group, args.message, to=args.to,
                                     instance=args.instance, timeout=args.timeout)
    except trio.TooSlowError:
        if not directed:
            why = f"is a `skan reply {args.group}` running?"
        elif before is not None and await _undeliverable(client) == before:
            why = (f"{args.to} received it and did not answer: is it a `skan reply "
                   f"{args.group}`?")
        else:
            why = (f"the broker found no recipient: no connection has the lname {args.to} "
                   f"and subscribes to {args.group} (lnames change on every connection: "
                   "`skan reply` prints its own, `skan connections` lists them)")
        print(f"{PROG}: no reply within {args.timeout:g}s ({why})", file=sys.stderr)
        return 1
    cliutil.out(format_message(reply, args.json))
    return 0


async def _undeliverable(client: SkanClient) -> int | None:
    try:
        return int((await client.stats()).get("undeliverable", 0))
    except (TypeError, ValueError):
        return None


async def _reply(client: SkanClient, args: argparse.Namespace) -> int:
    await client.subscribe(args.group, args.instance, "normal")
    cliutil.note(f"replying to requests on {args.group}/{args.instance} as {client.lname}")
    n = 0
    async for m in client:
        if m.repl is not None:
            continue  # a reply, not a request: answering it could loop between responders
        answer = m.msg if args.text is None else args.text
        await client.reply(m, answer)
        cliutil.out(format_message(m))
        n += 1
        if args.count and n >= args.count:
            await client.barrier()
            return 0
    return _ended(client)


async def _stats(client: SkanClient, args: argparse.Namespace) -> int:
    stats = await client.stats()
    width = max(map(len, stats), default=0)
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        cliutil.out(f"{key:<{width}}  {value}")
    return 0


COMMANDS = {"pub": _pub, "sub": _sub, "request": _request, "reply": _reply, "stats": _stats}


# Commands that talk HTTP to the metrics port, not Skan to the broker port.
LISTING_COMMANDS = ("connections", "subscriptions")


async def run(args: argparse.Namespace) -> int:
    if args.command in LISTING_COMMANDS:
        return await _listing(args)
    async with _connect(args) as client:
        return await COMMANDS[args.command](client, args)


def _own_errors(target: str):
    def describe(exc: BaseException) -> str | None:
        if isinstance(exc, SkanClosed):
            return str(exc) if exc.reason.startswith(target) else f"{target}: {exc.reason}"
        if isinstance(exc, SkanClientError):
            return f"broker refused: {exc.reason}"
        if isinstance(exc, HSPError):
            return f"broker refused: {exc}"
        if isinstance(exc, HSPClosed):
            return f"{target}: {exc}"
        return None

    return describe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = args.metrics_port if args.command in LISTING_COMMANDS else args.port
    target = f"{args.host}:{port}"
    return cliutil.run(PROG, run, args, target=target, errors=_own_errors(target))


if __name__ == "__main__":
    sys.exit(main())
