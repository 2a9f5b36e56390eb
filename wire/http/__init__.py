"""Minimal sans-IO HTTP/1.1 server side (request heads in, responses out) for /metrics."""

from wire.http.server import MAX_HEAD, HTTPError, Request, RequestReader, parse_head, response

__all__ = ["MAX_HEAD", "HTTPError", "Request", "RequestReader", "parse_head", "response"]
