"""The server side of a minimal HTTP/1.1: request heads in, response bytes out.

Sans-IO in the manner of h11: :class:`RequestReader` is fed received bytes
and returns parsed :class:`Request` heads, or one :class:`HTTPError` after
which the connection must be answered and closed (the byte stream can no
longer be trusted).  :func:`response` formats a complete response.

Scope: what a metrics endpoint needs.  Requests carry no body (GET/HEAD
scrapes); a request announcing one is answered with an error and the
connection closed, since skipping an unread body safely would need a body
reader this server has no use for.  Pipelined requests are returned in
order.  Lines may end in CRLF or a bare LF (RFC 9112 section 2.2 allows a
recipient to accept LF).
"""

from __future__ import annotations

import re

import attrs

# A request head larger than this is refused (431): a scrape request is a
# few hundred bytes, and the limit caps what one client can make us buffer.
MAX_HEAD = 8192
# Header fields per request; real scrapers send fewer than ten.
MAX_HEADERS = 64

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_HEAD_END = re.compile(rb"\r?\n\r?\n")

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


@attrs.frozen
class Request:
    method: str
    target: str
    # (1, 1) for HTTP/1.1
    version: tuple[int, int]
    # Field names lower-cased, values stripped, in arrival order.
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The last value of a header field (names compare case-insensitively)."""
        name = name.lower()
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told ``close``; HTTP/1.0 always closes."""
        tokens = {t.strip().lower() for t in (self.header("connection") or "").split(",")}
        return self.version >= (1, 1) and "close" not in tokens

    @property
    def has_body(self) -> bool:
        length = self.header("content-length")
        return self.header("transfer-encoding") is not None or (
            length is not None and int(length) > 0
        )


@attrs.frozen
class HTTPError:
    """The request could not be parsed; answer ``status`` with ``reason`` and close."""

    status: int
    reason: str


class RequestReader:
    """Incremental request-head parser for one connection."""

    def __init__(self, max_head: int = MAX_HEAD) -> None:
        self.max_head = max_head
        self._buf = b""
        self.failed = False

    @property
    def buffered(self) -> int:
        """Bytes of a request that is not complete yet (0 between requests)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Request | HTTPError]:
        """Parse every complete request head in the stream so far.

        After an :class:`HTTPError` nothing more is parsed: the caller answers
        it and closes the connection.
        """
        if self.failed:
            return []
        self._buf += data
        out: list[Request | HTTPError] = []
        while self._buf:
            # Blank lines before a request line are ignored (RFC 9112 2.2).
            stripped = self._buf.lstrip(b"\r\n")
            if len(stripped) != len(self._buf):
                self._buf = stripped
                continue
            end = _HEAD_END.search(self._buf, 0, self.max_head + 4)
            if end is None:
                if len(self._buf) > self.max_head:
                    out.append(self._fail(431, f"request head exceeds {self.max_head} bytes"))
                break
            head, self._buf = self._buf[: end.start()], self._buf[end.end() :]
            parsed = parse_head(head)
            if isinstance(parsed, HTTPError):
                out.append(self._fail(parsed.status, parsed.reason))
                break
            out.append(parsed)
            if parsed.has_body:
                # We will not read the body, so nothing after it can be parsed.
                self.failed = True
                self._buf = b""
                break
        return out

    def _fail(self, status: int, reason: str) -> HTTPError:
        self.failed = True
        self._buf = b""
        return HTTPError(status, reason)


def parse_head(head: bytes) -> Request | HTTPError:
    """Parse a request line plus header fields (without the blank line)."""
    lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not all(parts):
        return HTTPError(400, "malformed request line (expected 'METHOD TARGET HTTP/1.1')")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        return HTTPError(400, "malformed request method")
    match = _VERSION.fullmatch(version)
    if match is None:
        return HTTPError(400, "malformed HTTP version")
    if match.group(1) != b"1":
        return HTTPError(505, "only HTTP/1.0 and HTTP/1.1 are supported")
    if any(b < 0x21 or b > 0x7E for b in target):
        return HTTPError(400, "request target must be visible ASCII")
    if len(lines) - 1 > MAX_HEADERS:
        return HTTPError(431, f"more than {MAX_HEADERS} header fields")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            return HTTPError(400, "malformed header field")
        try:
            text = value.strip(b" \t").decode("ascii")
        except UnicodeDecodeError:
            return HTTPError(400, "header field value must be ASCII")
        headers.append((name.decode("ascii").lower(), text))
    request = Request(
        method.decode("ascii"),
        target.decode("ascii"),
        (1, int(match.group(2))),
        tuple(headers),
    )
    length = request.header("content-length")
    if length is not None and not length.isdigit():
        return HTTPError(400, "malformed Content-Length")
    return request


def response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    keep_alive: bool = True,
    head_only: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A complete HTTP/1.1 response; ``head_only`` (HEAD) omits the body but keeps its length."""
    lines = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive" if keep_alive else "Connection: close",
        *(f"{name}: {value}" for name, value in headers),
    ]
    out = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return out if head_only else out + body
