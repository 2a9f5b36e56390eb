"""Remote interest: which groups the other brokers of a cluster want (pure).

A broker publishes a routed message to NATS only when another broker may
want it (BROKER-SPEC section 8).  NATS knows where interest is, but asking
it costs a write and NATS's parsing of every message nobody wants; so each
broker also announces its aggregated interest on :data:`SUBJECT`: the
groups where it has local subscribers, and ``everything`` while a Hat
pattern whose first segment is a wildcard is subscribed.

Messages (one NATS message each; the announcer's one NATS connection keeps
them in order)::

    SKI <server> <seq> hello <part> <parts>\\n<token>\\n...   full set, answer with yours
    SKI <server> <seq> full <part> <parts>\\n<token>\\n...    full set (periodic)
    SKI <server> <seq> + \\n<token>\\n                          a token gained
    SKI <server> <seq> - \\n<token>\\n                          a token lost

A token is a group, every byte outside ``[A-Za-z0-9_-]`` as ``%XX`` (no
hashing: it must come back exactly), or ``>`` for everything.  ``seq``
counts the announcer's messages: a receiver that sees a gap (a message its
announcer could not queue, or one it missed) forgets that broker's set
until its next full set.  A full set too large for one NATS message
travels in parts, applied when the last arrives.

Safety: while a broker's interest is unknown, this broker publishes
everything, as it would without this knowledge.  Unknown means: within
:attr:`RemoteInterest.blind` seconds of (re)connecting to NATS (every live
broker announces its full set with each heartbeat, and answers a
``hello`` at once); a broker heard (heartbeat or delta) whose full set has
not arrived; a broker whose messages had a gap.  A broker not heard for
:attr:`RemoteInterest.expire` seconds (three heartbeats, as "brokers
seen") is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.cluster.subjects import _SAFE
from wire.errors import MalformedError

SUBJECT = b"skc.int"
MAGIC = b"SKI"
EVERYTHING = b">"
HELLO, FULL, ADD, DROP = b"hello", b"full", b"+", b"-"
# Payload bytes of one full-set part at most: far below NATS's max_payload
# (1 MiB by default), so a broker with very many groups announces them in
# several messages rather than being refused by NATS.
PART_BYTES = 256 * 1024
_ESCAPE = [bytes([b]) if b in _SAFE else b"%%%02X" % b for b in range(256)]
_HEX = frozenset(b"0123456789ABCDEF")


def escape(group: bytes) -> bytes:
    """A group as a token: reversible, never empty, never ``>``."""
    if group and all(b in _SAFE for b in group):
        return group
    return b"".join(_ESCAPE[b] for b in group) or b"%"


def unescape(token: bytes) -> bytes:
    """The group of a token (MalformedError when it is not one :func:`escape` writes)."""
    if token == b"%":
        return b""
    if b"%" not in token:
        if not all(b in _SAFE for b in token):
            raise MalformedError("bad interest token")
        return token
    out = bytearray()
    i, n = 0, len(token)
    while i < n:
        b = token[i]
        if b == 0x25:  # %
            pair = token[i + 1:i + 3]
            if len(pair) != 2 or not _HEX.issuperset(pair):
                raise MalformedError("bad interest token")
            out.append(int(pair, 16))
            i += 3
        elif b in _SAFE:
            out.append(b)
            i += 1
        else:
            raise MalformedError("bad interest token")
    return bytes(out)


class Announcer:
    """This broker's side: the messages announcing its interest."""

    def __init__(self, server_id: int) -> None:
        self.server_id = server_id
        self.seq = 0

    def _line(self, kind: bytes, tail: bytes = b"") -> bytes:
        self.seq += 1
        return b"%s %d %d %s%s\n" % (MAGIC, self.server_id, self.seq, kind, tail)

    def full(self, groups: Iterable[bytes], everything: bool, hello: bool,
             part_bytes: int = PART_BYTES) -> list[bytes]:
        """The payloads of one full set (at least one; parts of at most ``part_bytes``
        of tokens, a longer token alone in its part)."""
        tokens = [EVERYTHING] if everything else []
        tokens += map(escape, groups)
        parts: list[list[bytes]] = [[]]
        size = 0
        for token in tokens:
            if size and size + len(token) + 1 > part_bytes:
                parts.append([])
                size = 0
            parts[-1].append(token)
            size += len(token) + 1
        kind = HELLO if hello else FULL
        return [self._line(kind, b" %d %d" % (i, len(parts))) + b"".join(t + b"\n" for t in p)
                for i, p in enumerate(parts)]

    def delta(self, group: bytes | None, added: bool) -> bytes:
        """One group (None: everything) gained or lost."""
        token = EVERYTHING if group is None else escape(group)
        return self._line(ADD if added else DROP, b" ") + token + b"\n"


class _Known:
    """What one other broker announced."""

    __slots__ = ("everything", "groups", "parts", "pending", "seq")

    def __init__(self) -> None:
        self.groups: set[bytes] = set()
        self.everything = False
        self.seq = 0
        # A full set arriving in parts: (groups, everything) so far.
        self.pending: tuple[set[bytes], list[bool]] | None = None
        self.parts = 0


class RemoteInterest:
    """The other brokers' interest, and :attr:`wanted`, what the out path reads:
    ``None`` (publish everything: someone wants everything, or someone's
    interest is unknown) or the groups some other broker wants."""

    def __init__(self, server_id: int, blind: float, expire: float) -> None:
        self.server_id = server_id
        # Seconds after (re)connecting during which interest counts as unknown.
        self.blind = blind
        # Seconds without a word from a broker before it is forgotten.
        self.expire = expire
        self._known: dict[int, _Known] = {}
        self._unknown: set[int] = set()
        self._heard: dict[int, float] = {}
        self._blind_until: float | None = None  # None: never connected
        self.wanted: set[bytes] | None = None

    # ---- events ----------------------------------------------------------

    def reset(self, now: float) -> None:
        """A fresh NATS connection: nothing is known (messages may have been missed)."""
        self._known.clear()
        self._unknown.clear()
        self._heard.clear()
        self._blind_until = now + self.blind
        self._update(now)

    def disconnected(self) -> None:
        """NATS lost: nothing is known until the next :meth:`reset` (what the
        broker cannot forward meanwhile is a drop, not a message nobody wants)."""
        self._known.clear()
        self._unknown.clear()
        self._heard.clear()
        self._blind_until = None
        self.wanted = None

    def heard(self, server: int, now: float) -> None:
        """A heartbeat from ``server``."""
        if server == self.server_id:
            return
        self._heard[server] = now
        if server not in self._known and server not in self._unknown:
            self._unknown.add(server)
            self.wanted = None

    def tick(self, now: float) -> None:
        """Forget brokers not heard for :attr:`expire`; end the blind window."""
        for server, when in list(self._heard.items()):
            if now - when >= self.expire:
                del self._heard[server]
                self._known.pop(server, None)
                self._unknown.discard(server)
        self._update(now)

    def receive(self, payload: bytes, now: float) -> bool:
        """Apply one interest message.  True when it is a complete ``hello`` (its
        sender wants our full set now).  MalformedError when it is malformed (the
        sender's interest then counts as unknown, if the sender can be told)."""
        nl = payload.find(b"\n")
        head = (payload if nl < 0 else payload[:nl]).split(b" ")
        if len(head) < 4 or head[0] != MAGIC or not head[1].isdigit() or not head[2].isdigit():
            raise MalformedError("bad interest message")
        server, seq, kind = int(head[1]), int(head[2]), head[3]
        if server == self.server_id:
            return False
        try:
            return self._apply(server, seq, kind, head[4:], payload[nl + 1:] if nl >= 0 else b"",
                               now)
        except MalformedError:
            self._forget_set(server)
            raise
        finally:
            self._update(now)

    # ---- state -----------------------------------------------------------

    def _apply(self, server: int, seq: int, kind: bytes, args: list[bytes], body: bytes,
               now: float) -> bool:
        self._heard[server] = now
        tokens = body.split(b"\n")
        if tokens[-1] != b"":
            raise MalformedError("interest message not ending in a newline")
        del tokens[-1]
        known = self._known.get(server)
        if kind in (HELLO, FULL):
            if len(args) != 2 or not args[0].isdigit() or not args[1].isdigit():
                raise MalformedError("bad full interest header")
            part, parts = int(args[0]), int(args[1])
            if not 0 <= part < parts:
                raise MalformedError("bad full interest part")
            if part == 0:
                if known is None:
                    known = _Known()
                    self._unknown.add(server)  # until its last part arrives
                pending: tuple[set[bytes], list[bool]] = (set(), [False])
                known.parts = parts
            elif (known is None or known.pending is None or seq != known.seq + 1
                    or parts != known.parts):
                self._forget_set(server)  # a part is missing: wait for the next full set
                return False
            else:
                pending = known.pending
            known.seq = seq
            groups, everything = pending
            for token in tokens:
                if token == EVERYTHING:
                    everything[0] = True
                else:
                    groups.add(unescape(token))
            if part + 1 < parts:
                known.pending = pending
                self._known[server] = known
                return False
            known.pending = None
            known.groups, known.everything = groups, everything[0]
            self._known[server] = known
            self._unknown.discard(server)
            return kind == HELLO
        if kind not in (ADD, DROP) or len(tokens) != 1:
            raise MalformedError("bad interest delta")
        if known is None or known.pending is not None or seq != known.seq + 1:
            self._forget_set(server)  # deltas only apply to a complete, gap-free set
            return False
        known.seq = seq
        token = tokens[0]
        if token == EVERYTHING:
            known.everything = kind == ADD
        elif kind == ADD:
            known.groups.add(unescape(token))
        else:
            known.groups.discard(unescape(token))
        return False

    def _forget_set(self, server: int) -> None:
        self._known.pop(server, None)
        self._unknown.add(server)

    def _update(self, now: float) -> None:
        if self._blind_until is None or now < self._blind_until:
            self.wanted = None
            return
        if self._unknown or any(k.everything for k in self._known.values()):
            self.wanted = None
            return
        wanted: set[bytes] = set()
        for known in self._known.values():
            wanted |= known.groups  # the last complete set (a new one may be arriving)
        self.wanted = wanted

    @property
    def state(self) -> str:
        """``everything`` (publishing all: blind, unknown or wanted), or ``known``."""
        return "everything" if self.wanted is None else "known"

    def brokers(self) -> dict[int, str]:
        """Per other broker: ``known`` or ``unknown`` (for stats and tests)."""
        out = dict.fromkeys(self._known, "known")
        out.update(dict.fromkeys(self._unknown, "unknown"))
        return out
