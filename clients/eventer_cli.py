"""``skan-eventer``: subscribe, register and query from the command line (events as JSON lines).

The client itself is :class:`toolkit.eventer_client.EventerClient`.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Iterable
from typing import Any

from toolkit import cliutil
from toolkit.eventer_client import (
    CLI_CLIENT_NAME,
    DEFAULT_PORT,
    PROG,
    EventerClient,
    EventerError,
)
from toolkit.streams import CONNECT_TIMEOUT
from wire.eventer import (
    BinaryPayload,
    Event,
    EventId,
    JsonPayload,
    Order,
    Payload,
    QueryLatestParams,
    QueryParams,
    QueryServerParams,
    QueryTimeseriesParams,
    RegisterEvent,
    Timestamp,
)


def event_json(event: Event) -> dict[str, Any]:
    """An event as plain JSON (binary data base64), for printing."""
    p = event.payload
    payload: Any
    if isinstance(p, JsonPayload):
        payload = {"json": p.data}
    elif isinstance(p, BinaryPayload):
        payload = {"binary": {"type": p.type, "data": base64.b64encode(p.data).decode()}}
    else:
        payload = None
    st = event.source_timestamp
    return {
        "id": [event.id.server, event.id.session, event.id.instance],
        "type": list(event.type),
        "timestamp": event.timestamp.to_float(),
        "source_timestamp": None if st is None else st.to_float(),
        "payload": payload,
    }


def _print(events: Iterable[Event]) -> None:
    for event in events:
        cliutil.out(json.dumps(event_json(event), ensure_ascii=False))


async def _run(args: argparse.Namespace) -> int:
    target = f"{args.host}:{args.port}"
    subs = args.patterns if args.command == "subscribe" else []
    async with EventerClient.connect(
        args.host, args.port, args.client_name, token=args.token, subscriptions=subs,
        ssl_context=cliutil.client_ssl_context(args), timeout=args.timeout,
        connect_timeout=args.timeout,
    ) as client:
        if args.command == "subscribe":
            cliutil.note(f"subscribed to {', '.join('/'.join(p) for p in subs)} at {target}")
            async for batch in client:
                _print(batch)
            raise client._failure or EventerError("connection closed by the server")
        if args.command == "register":
            payload: Payload = None
            if args.json is not None:
                payload = JsonPayload(args.json)
            elif args.binary is not None:
                payload = BinaryPayload(*args.binary)
            source = None if args.source_timestamp is None else Timestamp.from_float(
                args.source_timestamp)
            events = await client.register([RegisterEvent(args.type, source, payload)])
            if events is None:
                print(f"{PROG}: the server refused the registration", file=sys.stderr)
                return 1
            _print(events)
            return 0
        types = tuple(args.types) if args.types else None
        last = None if args.last_event_id is None else EventId(*args.last_event_id)
        params: QueryParams
        if args.kind == "latest":
            params = QueryLatestParams(types)
        elif args.kind == "timeseries":
            params = QueryTimeseriesParams(
                event_types=types, order=Order(args.order), max_results=args.max_results,
                last_event_id=last)
        else:
            params = QueryServerParams(args.server_id, max_results=args.max_results,
                                       last_event_id=last)
        result = await client.query(params)
        _print(result.events)
        if result.more_follows:
            cliutil.note("more events follow (page on with --last-event-id)")
        return 0


def _binary(text: str) -> tuple[str, bytes]:
    btype, sep, data = text.partition(":")
    if not sep or not btype:
        raise argparse.ArgumentTypeError(f"bad binary payload {text!r} (TYPE:HEX expected)")
    return btype, cliutil.hex_bytes(data)


def build_parser() -> cliutil.Parser:
    p = cliutil.Parser(prog=PROG, description="Eventer client: subscribe, register, query "
                                              "(events printed as JSON lines).")
    cliutil.add_connection_options(p, default_port=DEFAULT_PORT, port_help="Eventer port")
    p.add_argument("--client-name", default=CLI_CLIENT_NAME, help="name sent in MsgInitReq")
    p.add_argument("--timeout", type=cliutil.positive_float, default=CONNECT_TIMEOUT,
                   metavar="SECONDS",
                   help="seconds to connect, and for each answer (MsgInitRes, queries)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("subscribe", help="print notified events")
    s.add_argument("patterns", nargs="+", type=cliutil.event_type,
                   help="event-type patterns, segments joined by '/' (e.g. 'plant/*')")
    r = sub.add_parser("register", help="register one event, print it as created")
    r.add_argument("type", type=cliutil.event_type, help="event type, segments joined by '/'")
    payload = r.add_mutually_exclusive_group()
    payload.add_argument("--json", type=cliutil.json_value, help="JSON payload")
    payload.add_argument("--binary", metavar="TYPE:HEX", type=_binary, help="binary payload")
    r.add_argument("--source-timestamp", type=float, metavar="SECONDS",
                   help="source timestamp, seconds since the epoch")
    q = sub.add_parser("query", help="print query results")
    q.add_argument("kind", choices=["latest", "timeseries", "server"], help="query kind")
    q.add_argument("--types", nargs="*", type=cliutil.event_type,
                   help="event-type patterns ('a/*'); all when not given")
    q.add_argument("--max-results", type=cliutil.non_negative_int,
                   help="at most this many events (the server's limit applies)")
    q.add_argument("--last-event-id", metavar="SERVER,SESSION,INSTANCE", type=cliutil.event_id,
                   help="page on after this event")
    q.add_argument("--order", choices=["descending", "ascending"], default="descending",
                   help="timeseries order")
    q.add_argument("--server-id", type=cliutil.non_negative_int, default=1,
                   help="server whose events a 'server' query returns")
    return p


def _own_errors(exc: BaseException) -> str | None:
    if isinstance(exc, EventerError):
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cliutil.finish_connection_args(args)
    return cliutil.run(PROG, _run, args, target=f"{args.host}:{args.port}", errors=_own_errors)


if __name__ == "__main__":
    sys.exit(main())
