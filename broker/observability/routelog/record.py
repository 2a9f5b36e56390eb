"""Routing-log records: one JSON Lines record per routed message (pure, no I/O).

A record carries the fields of BROKER-SPEC section 6, one line each::

    {"time_us":1718000000123456,"server":1,"lname":"6650_1@host","proto":"skan","group":"g",
     "instance":"*","to":"*","seq":"17","size":93,"recipients":{"skan":2},
     "delivered":2,"undeliverable":false}

``time_us`` is the routing time in Unix microseconds (an integer: formatting
a float costs three times more), ``server`` the ``server_id`` of the broker
that wrote the record (in a cluster each broker logs what it routed: a
message appears on the broker it entered, and again, with ``proto``
``cluster``, on every broker that received it from the backplane),
``lname``/``proto`` the sender's, ``seq`` is
empty if the message had none, ``size`` the routed Skan frame in bytes
(length prefix included, as the router counts it), ``recipients`` the copies
handed to each protocol (the sender excluded; ``{}`` when none),
``delivered`` their total and ``undeliverable`` true when it is 0.

Escaping: DATA values are bytes.  Printable ASCII without ``"``/``\\`` goes
in as is; anything else is decoded as UTF-8 and escaped by ``json``; bytes
that are not UTF-8 appear as ``\\xNN`` (backslash, x, two hex digits) so a
line is always valid JSON.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable

from broker.core.bounded import BoundedCache
from broker.core.router import Endpoint, Routed, Router
from wire.skan.codec import PURE_PYTHON

# broker/_observer_speedups.c formats the ASCII lines of a batch in one C loop; the
# Python loop (RecordBuffer.observe_py) is the reference and the fallback.
_lines_c = None
if not PURE_PYTHON:
    try:
        from broker._observer_speedups import routelog_lines as _lines_c
    except ImportError:  # pragma: no cover - built without a compiler
        _lines_c = None

# Record fields, in the order they are written (the analytics schema must match).
FIELDS = (
    "time_us", "server", "lname", "proto", "user", "group", "instance", "to", "seq", "size",
    "recipients", "delivered", "undeliverable",
)

_PLAIN = re.compile(rb"[\x20\x21\x23-\x5b\x5d-\x7e]*\Z")

# Bound of the per-(sender, routing key) fragment cache: it is simply
# cleared when full (rebuilding an entry is a few string operations).  It
# bounds memory when a broker sees endless distinct senders, routing keys or
# subscription changes, and releases the endpoints and tuples it holds.
PARTS_CACHE = 65_536


def json_str(value: bytes) -> str:
    """A JSON string literal for DATA bytes (see the module doc on escaping)."""
    if _PLAIN.match(value):
        return '"' + value.decode("ascii") + '"'
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = value.decode("utf-8", "backslashreplace")
    return json.dumps(text, ensure_ascii=False)


def recipients_json(recipients: Iterable[Endpoint], sender: Endpoint | None = None) -> str:
    """``{"proto": copies, ...}`` for a recipient set, leaving out the sender."""
    counts: dict[str, int] = {}
    for ep in recipients:
        if ep is not sender:
            counts[ep.protocol] = counts.get(ep.protocol, 0) + 1
    return "{" + ",".join(f'"{p}":{n}' for p, n in sorted(counts.items())) + "}"


class RecordBuffer:
    """Router observer: formats each routed message into a line and buffers it.

    Formatting happens here, on the routing path, because it is cheaper
    than handing the ``Routed`` objects to the writer thread: those hold
    GC-tracked headers and endpoints, and keeping thousands of them alive
    makes every garbage collection slower, while finished lines are plain
    strings the collector ignores.

    Everything that repeats is cached: the prefix
    ``"lname":..,"proto":..,"group":..,"instance":..,"to":..`` and the suffix
    ``,"recipients":{..},"delivered":N,"undeliverable":..}``, so only the time,
    ``seq`` and size are formatted per message.  The cache key is (sender,
    recipient tuple): the router builds one new tuple per routing key
    (group, instance, to, reply) and hands that same tuple out for every
    message of the key until a subscription changes, so the tuple stands for
    the key.  It is keyed by ``id`` and the cache entry holds the tuple, so
    the id cannot be reused by another tuple while cached.  The empty tuple
    is shared by every key without recipients, so undeliverable messages are
    keyed by (sender, group, instance, to) instead.

    Entries hold endpoints and tuples alive, so the cache is emptied at the
    first miss after any subscription or connection change (the router's
    ``generation``): tuples of older generations will not be seen again.

    ``on_full`` is called when ``limit`` lines are buffered; ``take`` empties
    the buffer.
    """

    def __init__(self, limit: int, on_full: Callable[[], None],
                 router: Router | None = None, server: int | None = None) -> None:
        self.lines: list[str] = []
        # time.time() when the oldest buffered line was routed (lag_seconds).
        self.first_at = 0.0
        # The writing broker's server id (the router's unless given).
        self.server = server if server is not None else (
            router.server_id if router is not None else 0)
        self.limit = limit
        self.on_full = on_full
        self._router = router
        self._generation = -1
        self._parts: BoundedCache[tuple, tuple[str, str, tuple[Endpoint, ...]]] = (
            BoundedCache(PARTS_CACHE))

    def add(self, routed: Routed) -> None:
        self.observe([routed])

    def observe(self, batch: list[Routed]) -> None:
        """Router observer: one line per routed message of the batch."""
        if not self.lines:
            self.first_at = time.time()
        if _lines_c is None:
            self.observe_py(batch)
        else:
            # The compiled loop formats every ASCII line; what it leaves
            # (a non-ASCII lname, group or seq, an odd timestamp) goes through
            # the reference one message at a time.
            lines, parts_of = self.lines, self._parts_of
            i, n = 0, len(batch)
            while i < n:
                i = _lines_c(batch, i, lines, parts_of, _seq)
                if i < n:
                    self._format(batch[i], parts_of(batch[i]))
                    i += 1
        if len(self.lines) >= self.limit:
            self.on_full()

    def observe_py(self, batch: list[Routed]) -> None:
        """The reference of :meth:`observe` (without the on_full check)."""
        last_key: tuple | None = None
        parts: tuple = ("", "", ())
        cache = self._parts
        for routed in batch:
            recips = routed.recipients
            h = routed.header
            # A batch is mostly one sender to one group: the previous
            # message's parts, without a dict lookup.
            key = (routed.sender, id(recips)) if recips else (
                routed.sender, h[b"group"], h[b"instance"], h[b"to"])
            if key != last_key:
                parts = cache.get(key) or self._new_parts(routed)
                last_key = key
            self._format(routed, parts)

    def _format(self, routed: Routed, parts: tuple) -> None:
        seq = routed.header.get(b"seq")
        try:
            sq = seq.decode() if seq.isdigit() else _seq(seq)
        except AttributeError:  # no seq, or not DATA (zero-cost when not raised)
            sq = _seq(seq)
        self.lines.append(
            f'{{"time_us":{int(routed.timestamp * 1e6)},{parts[0]},"seq":"{sq}",'
            f'"size":{len(routed.frame)}{parts[1]}'
        )

    def _parts_of(self, routed: Routed) -> tuple[str, str, tuple[Endpoint, ...]]:
        recips = routed.recipients
        if recips:
            key: tuple = (routed.sender, id(recips))
        else:
            h = routed.header
            key = (routed.sender, h[b"group"], h[b"instance"], h[b"to"])
        return self._parts.get(key) or self._new_parts(routed)

    def pending(self) -> int:
        return len(self.lines)

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def _new_parts(self, routed: Routed) -> tuple[str, str, tuple[Endpoint, ...]]:
        generation = self._router.generation if self._router is not None else 0
        if generation != self._generation:
            self._parts.clear()
            self._generation = generation
        sender, recips, h = routed.sender, routed.recipients, routed.header
        group, instance, to = h[b"group"], h[b"instance"], h[b"to"]
        principal = getattr(sender, "principal", None)
        name = principal.name if principal is not None else None
        # The sender's [[users]] name; null for anonymous clients (and full-rights bridges).
        user = "null" if name is None else json_str(name.encode())
        prefix = (
            f'"server":{self.server},"lname":{json_str(sender.lname)},'
            f'"proto":{json_str(sender.protocol.encode())},'
            f'"user":{user},"group":{json_str(group)},"instance":{json_str(instance)},'
            f'"to":{json_str(to)}'
        )
        d = routed.delivered
        suffix = (
            f',"recipients":{recipients_json(recips, sender)},"delivered":{d},'
            f'"undeliverable":{"false" if d else "true"}}}\n'
        )
        parts = (prefix, suffix, recips)
        if recips:
            self._parts.put((sender, id(recips)), parts)
        else:
            self._parts.put((sender, group, instance, to), parts)
        return parts

def _seq(seq: object) -> str:
    """``seq`` string contents, escaped (without quotes); empty when absent."""
    if type(seq) is not bytes:
        return ""
    return json_str(seq)[1:-1]


def format_records(batch: Iterable[Routed], server: int = 0) -> str:
    """JSON Lines text for some routed messages (tests, benchmarks, tools)."""
    buf = RecordBuffer(1 << 62, lambda: None, server=server)
    buf.observe(list(batch))
    return "".join(buf.take())
