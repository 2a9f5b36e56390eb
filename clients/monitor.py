"""Read the broker's connection listing (GET /connections, /subscriptions) and print tables.

The HTTP side is h11 over trio, one request per connection; the credentials
are the metrics listener's (``[metrics] token`` as ``Authorization: Bearer``,
``username``/``password`` as ``Authorization: Basic``), see docs/metrics.md.
"""

from __future__ import annotations

import base64
import calendar
import json
import ssl
import time
import urllib.parse
from typing import Any

import attrs
import h11
import trio

from toolkit.cliutil import UserError, WrongPeer

# Bytes of a listing reply we accept: MAX_LIMIT rows with their
# subscriptions fit easily; more means this is not the listing.
MAX_BODY = 64 * 1024 * 1024
RECV_SIZE = 65536


@attrs.frozen
class HTTPReply:
    status: int
    headers: dict[str, str]
    body: bytes


def authorization(token: str | None, user: str | None) -> str | None:
    """The Authorization header value for a bearer token or ``user:password``."""
    if token:
        return f"Bearer {token}"
    if user:
        return "Basic " + base64.b64encode(user.encode()).decode("ascii")
    return None


async def http_get(host: str, port: int, target: str, *, auth: str | None = None,
                   ssl_context: ssl.SSLContext | None = None,
                   timeout: float = 10.0) -> HTTPReply:
    """One GET; raises :class:`WrongPeer` when the port does not answer HTTP."""
    where = f"{host}:{port}"
    with trio.fail_after(timeout):
        if ssl_context is not None:
            stream: trio.abc.Stream = await trio.open_ssl_over_tcp_stream(
                host, port, ssl_context=ssl_context)
        else:
            stream = await trio.open_tcp_stream(host, port)
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            headers = [("Host", where), ("Accept", "application/json"),
                       ("Connection", "close"), ("User-Agent", "skan")]
            if auth is not None:
                headers.append(("Authorization", auth))
            await stream.send_all(conn.send(h11.Request(method="GET", target=target,
                                                        headers=headers)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            response: h11.Response | None = None
            body = bytearray()
            try:
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(RECV_SIZE)
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Response):
                        response = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                        if len(body) > MAX_BODY:
                            raise WrongPeer(f"{where}: reply larger than {MAX_BODY} bytes")
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
            except h11.RemoteProtocolError:
                raise WrongPeer(f"{where} does not answer HTTP: is it the broker's metrics "
                                "port ([metrics] port, 9914 by default)?") from None
    assert response is not None
    return HTTPReply(response.status_code,
                     {k.decode().lower(): v.decode(errors="replace")
                      for k, v in response.headers}, bytes(body))


async def fetch_listing(host: str, port: int, path: str, params: dict[str, Any], *,
                        auth: str | None, ssl_context: ssl.SSLContext | None,
                        timeout: float = 10.0) -> dict[str, Any]:
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    target = path + (f"?{query}" if query else "")
    reply = await http_get(host, port, target, auth=auth, ssl_context=ssl_context,
                           timeout=timeout)
    where = f"{host}:{port}"
    text = reply.body.decode("utf-8", errors="replace").strip()
    if reply.status == 401:
        hint = ("give the metrics credentials: --metrics-token or --metrics-user USER:PASSWORD "
                "(or SKAN_METRICS_TOKEN)")
        raise UserError(f"{where}: refused (401: {text or 'credentials required'}); {hint}")
    if reply.status == 403:
        raise UserError(f"{where}: {text}")
    if reply.status == 404:
        raise UserError(f"{where}: {path} not found (a broker older than the listing, or "
                        "not the broker's metrics port)")
    if reply.status != 200:
        raise UserError(f"{where}: HTTP {reply.status}: {text[:300]}")
    try:
        return json.loads(reply.body)
    except ValueError:
        raise WrongPeer(f"{where}{path} did not answer JSON: is it the broker's metrics "
                        "port?") from None


# ---- tables ------------------------------------------------------------------------------

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def human_count(n: int) -> str:
    return f"{n:,}"


def human_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Aligned columns; ``right`` holds the indexes of right-aligned (numeric) columns."""
    widths = [max([len(header[i]), *(len(r[i]) for r in rows)]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    return [line(header), *(line(r) for r in rows)]


def connection_lines(data: dict[str, Any], show_subs: bool = False) -> list[str]:
    header = ["LNAME", "PROTO", "USER", "REMOTE", "UP", "SUBS", "QUEUE", "QBYTES",
              "MSGS IN", "BYTES IN", "MSGS OUT", "BYTES OUT", "DROPPED"]
    rows = []
    for c in data["connections"]:
        rows.append([
            c["lname"], c["protocol"], c["user"] or "-", c["remote"] or "-",
            human_age(c["uptime"]), human_count(c["subscriptions"]),
            human_count(c["queue_frames"]), human_bytes(c["queue_bytes"]),
            human_count(c["msgs_in"]), human_bytes(c["bytes_in"]),
            human_count(c["msgs_out"]), human_bytes(c["bytes_out"]),
            human_count(c["dropped"]),
        ])
    lines = table(header, rows, right={4, 5, 6, 7, 8, 9, 10, 11, 12})
    if show_subs:
        out = [lines[0]]
        for line, c in zip(lines[1:], data["connections"], strict=True):
            out.append(line)
            for s in c.get("subscription_list") or ():
                out.append(f"    {_sub_text(s)}")
            more = c["subscriptions"] - len(c.get("subscription_list") or ())
            if more > 0:
                out.append(f"    ... {more} more (skan subscriptions --lname {c['lname']})")
        lines = out
    shown = len(data["connections"])
    lines.append(_footer(shown, data["total"], "connection", data))
    return lines


def _sub_text(s: dict[str, Any]) -> str:
    what = f"pattern {s['pattern']}" if "pattern" in s else f"{s['group']}/{s['instance']}"
    return f"{what} ({s['subtype']})"


def subscription_lines(data: dict[str, Any]) -> list[str]:
    header = ["GROUP", "INSTANCE/PATTERN", "SUBTYPE", "LNAME", "PROTO", "USER"]
    rows = []
    for s in data["subscriptions"]:
        if "pattern" in s:
            group, inst = "-", f"pattern {s['pattern']}"
        else:
            group, inst = s["group"], s["instance"]
        rows.append([group, inst, s["subtype"], s["lname"], s["protocol"], s["user"] or "-"])
    lines = table(header, rows, right=set())
    lines.append(_footer(len(rows), data["total"], "subscription", data))
    if data.get("truncated"):
        lines.append("# the broker listed only part of its subscriptions (too many): "
                     "filter with --group")
    return lines


def _footer(shown: int, total: int, noun: str, data: dict[str, Any]) -> str:
    first = data["offset"] + 1 if shown else 0
    plural = noun if total == 1 else noun + "s"
    age = ""
    try:
        now = _parse_iso(data["now"])
        taken = _parse_iso(data["snapshot"])
        if now - taken >= 0.5:
            age = f"; figures {now - taken:.1f}s old"
    except (KeyError, ValueError):
        pass
    return (f"# {first}-{data['offset'] + shown} of {total} {plural}, sorted by "
            f"{data['sort']} ({data['order']}){age}")


def _parse_iso(text: str) -> float:
    base, _, frac = text.rstrip("Z").partition(".")
    t = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    return t + (float(f"0.{frac}") if frac else 0.0)
