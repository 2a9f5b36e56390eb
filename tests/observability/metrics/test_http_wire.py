"""The sans-IO HTTP/1.1 request reader and response formatter behind /metrics."""

from __future__ import annotations

from wire.http import MAX_HEAD, HTTPError, Request, RequestReader, parse_head, response


def test_simple_get():
    [req] = RequestReader().feed(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n")
    assert isinstance(req, Request)
    assert (req.method, req.target, req.path, req.version) == (
        "GET", "/metrics?x=1", "/metrics", (1, 1))
    assert req.header("HOST") == "a"
    assert req.keep_alive and not req.has_body


def test_split_across_feeds_and_pipelined():
    reader = RequestReader()
    assert reader.feed(b"GET /a HTTP/1.1\r\nHo") == []
    assert reader.buffered
    out = reader.feed(b"st: x\r\n\r\nGET /b HTTP/1.1\r\n\r\nGET /c")
    assert [r.target for r in out] == ["/a", "/b"]
    assert [r.target for r in reader.feed(b" HTTP/1.1\n\n")] == ["/c"]  # bare LF accepted
    assert reader.buffered == 0


def test_connection_close_and_http10():
    [a] = RequestReader().feed(b"GET / HTTP/1.1\r\nConnection: Close\r\n\r\n")
    [b] = RequestReader().feed(b"GET / HTTP/1.0\r\n\r\n")
    [c] = RequestReader().feed(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert not a.keep_alive and not b.keep_alive and not c.keep_alive


def test_leading_blank_lines_ignored():
    [req] = RequestReader().feed(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n")
    assert req.target == "/"


def test_bad_request_lines():
    for line in (b"GET /\r\n\r\n", b"GET  / HTTP/1.1\r\n\r\n", b"G(T / HTTP/1.1\r\n\r\n",
                 b"GET / HTTP/1.x\r\n\r\n", b"GET / FTP/1.1\r\n\r\n",
                 b"GET /\x7f HTTP/1.1\r\n\r\n", b"\x00\x01\x02\r\n\r\n"):
        out = RequestReader().feed(line)
        assert len(out) == 1 and isinstance(out[0], HTTPError), line
        assert out[0].status == 400, line


def test_http2_version_refused():
    assert parse_head(b"GET / HTTP/2.0") == HTTPError(505, "only HTTP/1.0 and HTTP/1.1 are "
                                                           "supported")


def test_bad_headers():
    for head in (b"GET / HTTP/1.1\r\nno colon here", b"GET / HTTP/1.1\r\n bad: x",
                 b"GET / HTTP/1.1\r\nX: caf\xc3\xa9", b"GET / HTTP/1.1\r\nContent-Length: -1"):
        result = parse_head(head)
        assert isinstance(result, HTTPError) and result.status == 400, head
    many = b"GET / HTTP/1.1" + b"\r\nX: y" * 65
    assert parse_head(many).status == 431


def test_oversized_head_refused_once_and_stream_dropped():
    reader = RequestReader()
    out = reader.feed(b"GET /" + b"a" * MAX_HEAD)
    assert out == [HTTPError(431, f"request head exceeds {MAX_HEAD} bytes")]
    assert reader.feed(b" HTTP/1.1\r\n\r\n") == []  # failed: nothing more is parsed
    assert reader.buffered == 0


def test_head_just_under_the_limit_is_accepted():
    line = b"GET /" + b"a" * (MAX_HEAD - 20) + b" HTTP/1.1"
    [req] = RequestReader().feed(line + b"\r\n\r\n")
    assert isinstance(req, Request)


def test_request_with_body_stops_parsing():
    reader = RequestReader()
    out = reader.feed(
        b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\n\r\n"
    )
    assert len(out) == 1 and out[0].has_body
    assert reader.failed and reader.feed(b"GET / HTTP/1.1\r\n\r\n") == []
    [chunked] = RequestReader().feed(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert chunked.has_body


def test_response_format():
    data = response(200, b"hello", "text/plain", keep_alive=False, headers=(("Allow", "GET"),))
    assert data == (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
                    b"Connection: close\r\nAllow: GET\r\n\r\nhello")
    head = response(404, b"gone", head_only=True)
    assert head.endswith(b"Content-Length: 4\r\nConnection: keep-alive\r\n\r\n")
