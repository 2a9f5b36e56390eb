"""``skan-mariner``: print Mariner events as JSON lines.

    skan-mariner --port 23014 'sensors/*'

The client itself is :class:`toolkit.mariner_client.MarinerClient`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import trio

from toolkit import cliutil
from toolkit.mariner_client import CLI_CLIENT_ID, DEFAULT_PORT, PROG, MarinerClient, MarinerClosed
from toolkit.streams import CONNECT_TIMEOUT, open_stream, tidy_reason
from wire import mariner as mw


def event_to_json(event: mw.Event) -> dict[str, Any]:
    """An event as plain JSON (binary data base64), for printing."""
    return mw.event_json(event)


async def _subscribe(args: argparse.Namespace) -> int:
    target = f"{args.host}:{args.port}"
    last = None if args.last_event_id is None else mw.EventId(*args.last_event_id)
    try:
        stream = await open_stream(args.host, args.port, cliutil.client_ssl_context(args),
                                   args.timeout)
    except TimeoutError:
        raise cliutil.UserError(f"no connection to {target} within {args.timeout:g}s") from None
    async with MarinerClient.over(
        stream, client_id=args.client_id, client_token=args.token,
        last_event_id=last, subscriptions=args.patterns,
    ) as client:
        # A Mariner server answers ping with pong: one round trip proves the
        # port speaks Mariner and accepted init (a wrong token closes it).
        with trio.move_on_after(args.timeout) as handshake:
            try:
                await client.barrier()
            except MarinerClosed as exc:
                raise cliutil.WrongPeer(_not_mariner(target, exc.reason)) from None
        if handshake.cancelled_caught:
            raise cliutil.WrongPeer(
                f"{target} is not a Mariner server: no pong within {args.timeout:g}s")
        cliutil.note(f"subscribed to {', '.join('/'.join(p) for p in args.patterns)} "
                     f"at {target} as {args.client_id}")
        async for batch in client:
            for event in batch:
                cliutil.out(json.dumps(event_to_json(event), ensure_ascii=False))
        raise MarinerClosed(client.close_reason or "the server closed the connection")


def _not_mariner(target: str, reason: str) -> str:
    if reason.startswith("server error:"):
        # A Mariner server that refused init (wrong token...): it is one.
        return f"{target}: {reason}"
    return tidy_reason(f"{target} is not a Mariner server: {reason or 'it closed the connection'}")


def build_parser() -> cliutil.Parser:
    p = cliutil.Parser(prog=PROG, description="Print Mariner events as JSON lines.")
    p.add_argument("patterns", nargs="+", type=cliutil.event_type,
                   help="event-type patterns, segments joined by '/' (e.g. 'sensors/*')")
    cliutil.add_connection_options(p, default_port=DEFAULT_PORT, port_help="Mariner port")
    p.add_argument("--client-id", default=CLI_CLIENT_ID, help="client_id sent in init")
    p.add_argument("--last-event-id", metavar="SERVER,SESSION,INSTANCE", type=cliutil.event_id,
                   help="replay retained events after this one first")
    p.add_argument("--timeout", type=cliutil.positive_float, default=CONNECT_TIMEOUT,
                   metavar="SECONDS", help="seconds to connect and get the server's first pong")
    return p


def _own_errors(exc: BaseException) -> str | None:
    if isinstance(exc, MarinerClosed):
        return exc.reason
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cliutil.finish_connection_args(args)
    return cliutil.run(PROG, _subscribe, args, target=f"{args.host}:{args.port}",
                       errors=_own_errors)


if __name__ == "__main__":
    sys.exit(main())


