"""Remote interest: which groups the other brokers of a cluster want (pure).

A broker publishes a routed message to NATS only when another broker may
want it (BROKER-SPEC section 8).  NATS knows where interest is, but asking
it costs a write and NATS's parsing of every message nobody wants; so each
broker also announces its aggregated interest on ``skc.int.<server>``
(:data:`broker.cluster.subjects.INTEREST`, the subject names the announcer): the
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

from collections import Counter, deque
from collections.abc import Iterable, Iterator
from itertools import islice

from broker.cluster.subjects import _SAFE
from wire.errors import MalformedError, RemoteProtocolError

MAGIC = b"SKI"
EVERYTHING = b">"
HELLO, FULL, ADD, DROP = b"hello", b"full", b"+", b"-"
# Payload bytes of one full-set part at most: far below NATS's max_payload
# (1 MiB by default), so a broker with very many groups announces them in
# several messages rather than being refused by NATS.
PART_BYTES = 256 * 1024
# Other brokers whose interest is kept.  A cluster has a handful of brokers
# (one per core of its hosts); anything that makes up more is an attacker,
# and beyond this bound everything is published (safe) rather than state
# kept for it.
MAX_PEERS = 256
# Groups one broker's announced set may hold.  A broker's set is the groups
# its own clients subscribe to; a set larger than this makes that broker
# count as wanting everything (safe, and cheaper than tracking it).
MAX_PEER_GROUPS = 100_000
_SAFE_BYTES = frozenset(_SAFE)
_SAFE_DELETE = bytes(sorted(_SAFE))
# An interest message at most: a full-set part (PART_BYTES of tokens) and its
# line.  A larger one is refused before it is parsed (per-message work stays
# bounded whatever NATS's max_payload).
MAX_INTEREST_BYTES = PART_BYTES + 1024
# Escaped bytes (%XX) in one message at most: each costs a Python step to
# decode.  The announcer cuts its parts to respect it.
MAX_ESCAPES = 32_768
# A delta's token at most (an escaped group; groups are short).
MAX_TOKEN_BYTES = 4096
# Count changes made per step (see RemoteInterest.work): a few milliseconds.
WORK_CHUNK = 4096
_ESCAPE = [bytes([b]) if b in _SAFE else b"%%%02X" % b for b in range(256)]
_HEX = frozenset(b"0123456789ABCDEF")


def escape(group: bytes) -> bytes:
    """A group as a token: reversible, never empty, never ``>``."""
    if group and all(b in _SAFE for b in group):
        return group
    return b"".join(_ESCAPE[b] for b in group) or b"%"


class ForgedError(RemoteProtocolError):
    """A message that speaks for another broker than the one that published it."""


def unescape(token: bytes) -> bytes:
    """The group of a token (MalformedError when it is not one :func:`escape` writes)."""
    if token == b"%":
        return b""
    if b"%" not in token:
        if not _SAFE_BYTES.issuperset(token):
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
        size = escapes = 0
        for token in tokens:
            n = token.count(b"%")
            if size and (size + len(token) + 1 > part_bytes or escapes + n > MAX_ESCAPES):
                parts.append([])
                size = escapes = 0
            parts[-1].append(token)
            size += len(token) + 1
            escapes += n
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
        # The last complete set (its groups are counted in RemoteInterest._count).
        self.groups: set[bytes] = set()
        self.everything = False
        self.seq = 0
        # A full set arriving in parts: (groups, everything) so far.
        self.pending: tuple[set[bytes], list[bool]] | None = None
        self.parts = 0


class RemoteInterest:
    """The other brokers' interest, and :attr:`wanted`, what the out path reads:
    ``None`` (publish everything: someone wants everything, or someone's
    interest is unknown) or the groups some other broker wants.

    Every message costs work bounded by its own size, never by the whole
    state: the union of the announced sets is kept incrementally (a count
    per group of the brokers that want it), a delta is one set operation, a
    full set costs its difference with the last one.  A broker is held to
    :attr:`max_groups` groups (beyond: it counts as wanting everything until
    a full set within the bound arrives), and at most :attr:`max_peers`
    brokers have a set here (beyond: everything is published until they are
    forgotten).  Both fallbacks are safe: they publish more, never less.
    """

    def __init__(self, server_id: int, blind: float, expire: float, *,
                 max_peers: int = MAX_PEERS, max_groups: int = MAX_PEER_GROUPS) -> None:
        self.server_id = server_id
        # Seconds after (re)connecting during which interest counts as unknown.
        self.blind = blind
        # Seconds without a word from a broker before it is forgotten.
        self.expire = expire
        self.max_peers = max_peers
        self.max_groups = max_groups
        self._known: dict[int, _Known] = {}
        self._unknown: set[int] = set()
        self._heard: dict[int, float] = {}
        self._blind_until: float | None = None  # None: never connected
        # group -> how many known sets hold it (no zeros): the union of the
        # announced sets, and what :attr:`wanted` is once every count is done.
        self._count: Counter[bytes] = Counter()
        # Count changes still to make: (groups, +1 or -1), applied WORK_CHUNK
        # groups at a time by :meth:`work` (everything is published meanwhile).
        self._work: deque[tuple[Iterator[bytes], int]] = deque()
        self._now = 0.0
        self._everything = 0  # known sets wanting everything
        # Until when everything is published because a broker was refused
        # (over max_peers) or its set was (over max_groups).
        self._over_until = 0.0
        self.refused = 0  # interest messages or sets refused by a bound
        self.wanted: set[bytes] | None = None

    # ---- events ----------------------------------------------------------

    def reset(self, now: float) -> None:
        """A fresh NATS connection: nothing is known (messages may have been missed)."""
        self._clear()
        self._blind_until = now + self.blind
        self._update(now)

    def disconnected(self) -> None:
        """NATS lost: nothing is known until the next :meth:`reset` (what the
        broker cannot forward meanwhile is a drop, not a message nobody wants)."""
        self._clear()
        self._blind_until = None
        self.wanted = None

    def _clear(self) -> None:
        self._known.clear()
        self._unknown.clear()
        self._heard.clear()
        self._count = Counter()  # a new object: the out path may hold the old one
        self._work.clear()
        self._everything = 0
        self._over_until = 0.0

    def heard(self, server: int, now: float) -> None:
        """A heartbeat from ``server``."""
        if server == self.server_id or not self._admit(server, now):
            return
        self._heard[server] = now
        if server not in self._known and server not in self._unknown:
            self._unknown.add(server)
            self.wanted = None

    def restarted(self, server: int, now: float) -> None:
        """``server`` came back with a new boot id: what it announced before is void."""
        if server in self._heard:
            self._forget_set(server)
            self._update(now)

    def lost(self, server: int, now: float) -> None:
        """A message of ``server`` was lost unread: its set is unknown."""
        if server in self._heard:
            self._forget_set(server)
            self._update(now)

    def tick(self, now: float) -> None:
        """Forget brokers not heard for :attr:`expire`; end the blind window."""
        for server, when in list(self._heard.items()):
            if now - when >= self.expire:
                del self._heard[server]
                self._drop_known(server)
                self._unknown.discard(server)
        self._update(now)
        if self._work:
            self.work()

    def receive(self, payload: bytes, now: float, sender: int | None = None) -> bool:
        """Apply one interest message (``sender``: the server id its subject
        names; the message must speak for that broker).  True when it is a
        complete ``hello`` (its sender wants our full set now).  MalformedError
        when it is malformed (the sender's interest then counts as unknown)."""
        if len(payload) > MAX_INTEREST_BYTES:
            raise MalformedError(f"interest message of {len(payload)} bytes "
                                 f"(at most {MAX_INTEREST_BYTES})")
        nl = payload.find(b"\n")
        head = (payload if nl < 0 else payload[:nl]).split(b" ", 6)
        if (len(head) < 4 or head[0] != MAGIC or not head[1].isdigit() or not head[2].isdigit()
                or len(head[1]) > 19 or len(head[2]) > 19):
            raise MalformedError("bad interest message")
        server, seq, kind = int(head[1]), int(head[2]), head[3]
        if sender is not None and server != sender:
            raise ForgedError(f"interest of broker {server} published by broker {sender}")
        if server == self.server_id:
            return False
        if not self._admit(server, now):
            self.refused += 1
            self._update(now)
            return False
        try:
            return self._apply(server, seq, kind, head[4:], payload[nl + 1:] if nl >= 0 else b"",
                               now)
        except MalformedError:
            self._forget_set(server)
            raise
        finally:
            self._update(now)
            if self._work:
                self.work()  # a small change is applied at once

    # ---- state -----------------------------------------------------------

    def _admit(self, server: int, now: float) -> bool:
        """Whether ``server`` may have state here (at most max_peers brokers)."""
        if server in self._heard or len(self._heard) < self.max_peers:
            return True
        self._over_until = now + self.expire
        return False

    def _apply(self, server: int, seq: int, kind: bytes, args: list[bytes], body: bytes,
               now: float) -> bool:
        self._heard[server] = now
        if body and body[-1:] != b"\n":
            raise MalformedError("interest message not ending in a newline")
        known = self._known.get(server)
        if kind in (HELLO, FULL):
            if len(args) != 2 or not args[0].isdigit() or not args[1].isdigit() or max(
                    len(args[0]), len(args[1])) > 9:
                raise MalformedError("bad full interest header")
            part, parts = int(args[0]), int(args[1])
            if not 0 <= part < parts:
                raise MalformedError("bad full interest part")
            if part == 0:
                if known is None:
                    known = _Known()
                    self._known[server] = known
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
            if body:
                tokens = body[:-1].split(b"\n")
                if EVERYTHING in tokens:
                    everything[0] = True
                    tokens = [t for t in tokens if t != EVERYTHING]
                if b"" in tokens:
                    raise MalformedError("empty interest token")
                escapes = body.count(b"%")
                if escapes > MAX_ESCAPES:
                    raise MalformedError(f"interest message with {escapes} escapes "
                                         f"(at most {MAX_ESCAPES})")
                if escapes:
                    groups.update(map(unescape, tokens))
                elif not b"".join(tokens).translate(None, _SAFE_DELETE):
                    groups.update(tokens)  # every byte safe (checked in one C call)
                else:
                    raise MalformedError("bad interest token")
            if len(groups) > self.max_groups:
                # Over the bound: this broker counts as wanting everything
                # (safe: more is published) until a set within it arrives.
                self.refused += 1
                known.pending = None
                self._set(server, known, set(), True)
                self._unknown.discard(server)
                return False
            if part + 1 < parts:
                known.pending = pending
                return False
            known.pending = None
            self._set(server, known, groups, everything[0])
            self._unknown.discard(server)
            return kind == HELLO
        if kind not in (ADD, DROP) or body.count(b"\n") != 1 or len(body) > MAX_TOKEN_BYTES:
            raise MalformedError("bad interest delta")
        if known is None or known.pending is not None or seq != known.seq + 1:
            self._forget_set(server)  # deltas only apply to a complete, gap-free set
            return False
        known.seq = seq
        token = body[:-1]
        if token == EVERYTHING:
            if known.everything != (kind == ADD):
                known.everything = kind == ADD
                self._everything += 1 if kind == ADD else -1
            return False
        group = unescape(token)
        if kind == ADD:
            if group not in known.groups:
                if len(known.groups) >= self.max_groups:
                    self.refused += 1
                    self._set(server, known, set(), True)
                    return False
                known.groups.add(group)
                self._work.append((iter((group,)), 1))
        elif group in known.groups:
            known.groups.discard(group)
            self._work.append((iter((group,)), -1))
        return False

    def _set(self, server: int, known: _Known, groups: set[bytes], everything: bool) -> None:
        """Replace ``server``'s complete set, counting only the difference."""
        old = known.groups
        if groups != old:
            # Set differences in C; the counts follow in bounded steps (work()).
            added, removed = groups - old, old - groups
            if added:
                self._work.append((iter(added), 1))
            if removed:
                self._work.append((iter(removed), -1))
            known.groups = groups
        if everything != known.everything:
            self._everything += 1 if everything else -1
            known.everything = everything

    def work(self, budget: int = WORK_CHUNK) -> bool:
        """Make up to ``budget`` of the pending count changes; True while some
        remain (the caller yields to other tasks between calls)."""
        count, work = self._count, self._work
        while work and budget > 0:
            groups, sign = work[0]
            chunk = list(islice(groups, budget))
            if len(chunk) < budget:
                work.popleft()
            budget -= len(chunk) or 1
            if sign > 0:
                count.update(chunk)  # one C loop
            else:
                for group in chunk:
                    n = count[group] - 1
                    if n:
                        count[group] = n
                    else:
                        del count[group]
        if not work:
            self._update(self._now)
        return bool(work)

    def _drop_known(self, server: int) -> None:
        known = self._known.pop(server, None)
        if known is not None:
            self._set(server, known, set(), False)

    def _forget_set(self, server: int) -> None:
        self._drop_known(server)
        self._unknown.add(server)

    def _update(self, now: float) -> None:
        self._now = now
        if self._blind_until is None or now < self._blind_until:
            self.wanted = None
            return
        if self._unknown or self._everything or now < self._over_until or self._work:
            self.wanted = None
            return
        # The last complete sets (a new one may be arriving): the counted
        # groups, a live view (the out path only tests ``in``).
        self.wanted = self._count.keys()  # type: ignore[assignment]

    @property
    def busy(self) -> bool:
        """Whether count changes are pending (:meth:`work`)."""
        return bool(self._work)

    @property
    def state(self) -> str:
        """``everything`` (publishing all: blind, unknown or wanted), or ``known``."""
        return "everything" if self.wanted is None else "known"

    def brokers(self) -> dict[int, str]:
        """Per other broker: ``known`` or ``unknown`` (for stats and tests)."""
        out = dict.fromkeys(self._known, "known")
        out.update(dict.fromkeys(self._unknown, "unknown"))
        return out
