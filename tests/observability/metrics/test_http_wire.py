"""The sans-IO side of the metrics HTTP server: h11 plus the endpoint's own rules.

Bytes in, requests or errors out, replies to bytes: no sockets, no trio.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.observability.http import (
    MAX_HEAD,
    MAX_HEADERS,
    HTTPError,
    Reply,
    Request,
    ServerConnection,
)
from tests.examples import examples


def feed(data: bytes, conn: ServerConnection | None = None) -> Request | HTTPError | None:
    conn = conn or ServerConnection()
    conn.receive_data(data)
    return conn.next_request()


def requests(conn: ServerConnection, data: bytes) -> list[Request | HTTPError]:
    """Every request complete in the stream so far, each answered 200 in turn."""
    conn.receive_data(data)
    out = []
    while (item := conn.next_request()) is not None:
        out.append(item)
        conn.send_reply(Reply(200, b"ok"))
        if conn.closed:
            break
    return out


def test_simple_get():
    req = feed(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n")
    assert isinstance(req, Request)
    assert (req.method, req.target, req.path, req.version) == (
        "GET", "/metrics?x=1", "/metrics", (1, 1))
    assert req.header("HOST") == "a"
    assert req.keep_alive and not req.has_body


def test_split_across_feeds_and_pipelined():
    conn = ServerConnection()
    assert requests(conn, b"GET /a HTTP/1.1\r\nHo") == []
    assert conn.buffered
    out = requests(conn, b"st: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\nGET /c")
    assert [r.target for r in out] == ["/a", "/b"]
    assert [r.target for r in requests(conn, b" HTTP/1.1\nHost: x\n\n")] == ["/c"]  # bare LF
    assert conn.buffered == 0 and not conn.closed


def test_connection_close_and_http10():
    for data in (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Close\r\n\r\n",
                 b"GET / HTTP/1.0\r\n\r\n",
                 b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"):
        conn = ServerConnection()
        req = feed(data, conn)
        assert isinstance(req, Request) and not req.keep_alive, data
        out = conn.send_reply(Reply(200, b"x"))
        assert b"Connection: close\r\n" in out and conn.closed, data


def test_leading_blank_lines_ignored():
    req = feed(b"\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(req, Request) and req.target == "/"


def test_bad_request_lines():
    for line in (b"GET /\r\n\r\n", b"GET  / HTTP/1.1\r\n\r\n", b"G(T / HTTP/1.1\r\n\r\n",
                 b"GET / HTTP/1.x\r\n\r\n", b"GET / FTP/1.1\r\n\r\n",
                 b"GET /\x7f HTTP/1.1\r\n\r\n", b"\x00\x01\x02\r\n\r\n"):
        out = feed(line)
        assert isinstance(out, HTTPError), line
        assert out.status == 400, line


def test_http11_needs_host():
    """RFC 9112 section 3.2: an HTTP/1.1 request without Host is a 400 (h11 enforces it)."""
    out = feed(b"GET /metrics HTTP/1.1\r\n\r\n")
    assert isinstance(out, HTTPError) and out.status == 400 and "Host" in out.reason
    assert isinstance(feed(b"GET /metrics HTTP/1.0\r\n\r\n"), Request)


def test_http2_version_refused():
    assert feed(b"GET / HTTP/2.0\r\nHost: x\r\n\r\n") == HTTPError(
        505, "only HTTP/1.0 and HTTP/1.1 are supported")


def test_bad_headers():
    for head in (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here", b"GET / HTTP/1.1\r\n bad: x",
                 b"GET / HTTP/1.1\r\nHost: x\r\nX: caf\xc3\xa9",
                 b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1",
                 b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 10_000):
        result = feed(head + b"\r\n\r\n")
        assert isinstance(result, HTTPError) and result.status == 400, head[:60]
    many = b"GET / HTTP/1.1\r\nHost: x" + b"\r\nX: y" * MAX_HEADERS + b"\r\n\r\n"
    result = feed(many)
    assert isinstance(result, HTTPError) and result.status == 431


def test_oversized_head_refused_once_and_stream_dropped():
    conn = ServerConnection()
    out = feed(b"GET /" + b"a" * MAX_HEAD, conn)
    assert out == HTTPError(431, f"request head exceeds {MAX_HEAD} bytes")
    data = conn.send_reply(Reply(431, b"too big\n", close=True))
    assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert conn.closed
    conn.receive_data(b" HTTP/1.1\r\n\r\n")
    assert conn.next_request() is None  # closed: nothing more is parsed


def test_head_just_under_the_limit_is_accepted():
    line = b"GET /" + b"a" * (MAX_HEAD - 30) + b" HTTP/1.1\r\nHost: x"
    assert isinstance(feed(line + b"\r\n\r\n"), Request)


def test_request_with_body_stops_parsing():
    conn = ServerConnection()
    out = requests(
        conn, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
              b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(out) == 1 and out[0].has_body
    assert conn.closed and requests(conn, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == []
    chunked = feed(b"PUT / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert chunked.has_body
    # Only chunked transfer coding exists in HTTP/1.1 framing: others are refused.
    gzip = feed(b"PUT / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n")
    assert isinstance(gzip, HTTPError) and gzip.status == 501


def test_response_format():
    conn = ServerConnection()
    feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", conn)
    data = conn.send_reply(Reply(200, b"hello", "text/plain", (("Allow", "GET"),), close=True))
    assert data == (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
                    b"Connection: close\r\nAllow: GET\r\n\r\nhello")
    conn = ServerConnection()
    feed(b"HEAD /gone HTTP/1.1\r\nHost: x\r\n\r\n", conn)
    head = conn.send_reply(Reply(404, b"gone"))
    assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert head.endswith(b"Content-Length: 4\r\nConnection: keep-alive\r\n\r\n")
    assert not conn.closed


def test_errors_outside_a_request():
    conn = ServerConnection()
    conn.receive_data(b"GET /met")
    assert conn.next_request() is None and conn.buffered
    data = conn.fail(408, "request not completed in time")
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert data.endswith(b"Connection: close\r\n\r\nrequest not completed in time\n")
    assert conn.closed


def test_peer_close_mid_request_is_an_error_and_between_requests_is_not():
    conn = ServerConnection()
    conn.receive_data(b"GET /me")
    conn.receive_data(b"")
    out = conn.next_request()
    assert isinstance(out, HTTPError) and out.status == 400
    conn = ServerConnection()
    conn.receive_data(b"")
    assert conn.next_request() is None and conn.peer_closed



VALID = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"


def _drive(chunks: list[bytes]) -> None:
    """Feed chunks, answering every request: nothing but requests and errors comes out."""
    conn = ServerConnection()
    for chunk in [*chunks, b""]:
        conn.receive_data(chunk)
        while (item := conn.next_request()) is not None:
            assert isinstance(item, Request | HTTPError)
            out = conn.send_reply(Reply(200 if isinstance(item, Request) else item.status, b"x"))
            assert out.startswith(b"HTTP/1.1 ")
            if conn.closed:
                return


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_any_bytes_give_requests_or_errors_never_an_exception(chunks):
    _drive(chunks)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.binary(min_size=1, max_size=4)),
                min_size=1, max_size=4), st.integers(1, 5))
def test_mutated_requests_never_raise(edits, copies):
    data = bytearray(VALID * copies)
    for pos, new in edits:
        data[pos:pos + len(new)] = new
    _drive([bytes(data[i:i + 7]) for i in range(0, len(data), 7)])


def test_error_reply_to_a_head_request_has_no_body():
    """Found by the listener fuzz suite: ``HEAD / HTTP/2.0`` is refused with 505,
    and h11 frames any response to HEAD without a body; sending the error text
    as body raised inside h11 (a logged traceback)."""
    from broker.observability.http import answer

    conn = ServerConnection()
    item = feed(b"HEAD / HTTP/2.0\r\nHost: x\r\n\r\n", conn)
    assert isinstance(item, HTTPError) and item.status == 505
    data = conn.send_reply(answer(item, lambda: b""))
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 505 ") and body == b""
    assert b"Content-Length: " in head and conn.closed
