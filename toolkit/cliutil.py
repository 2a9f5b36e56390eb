"""Plumbing every command-line tool shares: parsing, input checks, running, error lines.

One place decides how a tool behaves when something goes wrong, so that
``skan``, ``skan-eventer``, ``skan-mariner``, ``skan-broker`` and
``skan-analytics`` all follow the same rules:

- a user error (bad flag, bad JSON, bad hex, bad event id) is one line on
  stderr and exit code 2, found before anything connects;
- a peer or network error is one line naming the host:port (or file) and
  exit code 1;
- Ctrl-C exits 130 without a traceback;
- every option's help states its default (:class:`Parser` adds it).

A Python traceback is printed only for a bug (an exception no rule here
expects), and only when ``SKAN_DEBUG=1``; otherwise one line says it is one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
from collections.abc import Callable, Coroutine
from importlib import metadata
from typing import Any, NoReturn

import trio

from toolkit.streams import DEFAULT_HOST, env_token
from toolkit.streams import tidy_reason as tidy_reason
from wire.skan.jsonvalue import JsonValueError, json_to_skan

# Distribution whose version every tool reports with --version.
DISTRIBUTION = "skan-broker"

# Exit codes, as BSD sysexits and shells use them.
EXIT_OK = 0
EXIT_FAILURE = 1  # the peer, the network or a file said no
EXIT_USAGE = 2  # the command line itself is wrong (argparse's code too)
EXIT_BUG = 70  # EX_SOFTWARE: an exception nobody expected
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def version() -> str:
    """The installed package's version (from its metadata), or "unknown" in a bare checkout."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


class UserError(Exception):
    """Something the user can fix; ``code`` is the exit code, the message is the one line."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


class WrongPeer(UserError):
    """The port answered, but not in the protocol the tool speaks."""


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Help with "(default: X)" on every option that has a default (flags and None have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or (
                "%(default)" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


class _DefaultsFormatter(_DefaultsHelp, argparse.RawDescriptionHelpFormatter):
    """:class:`_DefaultsHelp` keeping the description's lines (its examples) as written."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and whose help shows every default.

    ``--version`` is added to every top-level parser.  Options and positionals
    may be mixed in any order (``skan pub GROUP --instance I MESSAGE``):
    every parser without subcommands parses "intermixed", and a
    subcommand also accepts the top-level options (``skan stats --port P``;
    see :meth:`share_options`).
    """

    def __init__(self, *args: Any, version_flag: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self._intermixing = False
        if version_flag:
            self.add_argument("--version", action="version",
                              version=f"%(prog)s {version()}",
                              help="print the version and exit")

    def add_subparsers(self, **kwargs: Any) -> Any:
        kwargs.setdefault("parser_class", _SubParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # argparse's default fills the positionals it can at the first option
        # (``pub GROUP --instance I MESSAGE`` leaves MESSAGE "unrecognized");
        # intermixed parsing takes options first, then every positional.  It
        # cannot apply to a parser with subcommands, whose own positionals
        # (the command) come before the subparser's arguments.
        if self._intermixing or self._subparsers is not None:
            self.share_options()
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def share_options(self) -> None:
        """Give every subcommand the top-level options it does not define itself,
        with no default of their own (a value given before the command stays),
        so ``skan stats --port P`` means ``skan --port P stats``."""
        if self._subparsers is None:
            return
        shared = [a for a in self._actions if a.option_strings
                  and not isinstance(a, argparse._HelpAction | argparse._VersionAction)]
        for action in self._subparsers._group_actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for sub in action.choices.values():
                if getattr(sub, "_options_shared", False):
                    continue
                sub._options_shared = True
                for option in shared:
                    if not any(s in sub._option_string_actions for s in option.option_strings):
                        sub._add_action(_copy_action(option))

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _copy_action(action: argparse.Action) -> argparse.Action:
    """``action`` for a subcommand's parser: same option, no default (SUPPRESS)."""
    copy = argparse.Action.__new__(type(action))
    copy.__dict__.update(action.__dict__)
    copy.default = argparse.SUPPRESS
    copy.required = False
    return copy


class _SubParser(Parser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, version_flag=False, **kwargs)


# ---- argument types: validate input before anything connects ------------------------------


def json_value(text: str) -> Any:
    """``type=`` for a JSON argument: the parsed value, or a one-line usage error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"bad JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("bad JSON (nested too deeply)") from None


def skan_json(text: str) -> Any:
    """``type=`` for a JSON message sent over Skan: the Skan value (HASH/LIST/DATA/NULL)."""
    value = json_value(text)
    try:
        return json_to_skan(value, "message")
    except JsonValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hex_bytes(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad hex {text!r} (pairs of 0-9a-f expected)") from None


def event_id(text: str) -> tuple[int, int, int]:
    """``SERVER,SESSION,INSTANCE`` -> three non-negative integers."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"bad event id {text!r} (SERVER,SESSION,INSTANCE: three non-negative integers)")
    server, session, instance = (int(p) for p in parts)
    return server, session, instance


def event_type(text: str) -> tuple[str, ...]:
    """An event type or pattern written with '/' between segments."""
    if not text or text.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"bad event type {text!r} (segments joined by '/', the first non-empty)")
    return tuple(text.split("/"))


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text}")
    return text


def add_connection_options(p: argparse.ArgumentParser, *, default_port: int | None,
                           port_help: str = "server port") -> None:
    """--host, --port, TLS and credential options, the same in every client tool."""
    p.add_argument("--host", default=DEFAULT_HOST, help="server host")
    p.add_argument("--port", type=port, default=default_port, help=port_help)
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--tls-ca", "--ca", dest="tls_ca", type=readable_file, metavar="FILE",
                   help="CA file that signed the server's certificate (system CAs if unset)")
    p.add_argument("--insecure", action="store_true",
                   help="TLS without verifying the server's certificate (testing only)")
    p.add_argument("--tls-cert", "--cert", dest="tls_cert", type=readable_file, metavar="FILE",
                   help="client certificate (PEM) to present; implies --tls")
    p.add_argument("--tls-key", "--key", dest="tls_key", type=readable_file, metavar="FILE",
                   help="private key of --tls-cert (if not in the same file)")
    p.add_argument("--token", help="credential for the broker's [[users]] or the server's "
                   "token (default: the SKAN_TOKEN environment variable)")


def finish_connection_args(args: argparse.Namespace) -> None:
    """After parsing: the token from $SKAN_TOKEN when not given (never shown as a help
    default), and TLS on when a client certificate is given."""
    args.token = env_token(args.token)
    args.tls = args.tls or args.tls_cert is not None


def client_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls:
        return None
    ctx = ssl.create_default_context(cafile=args.tls_ca)
    if args.tls_cert is not None:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    if args.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# ---- running ---------------------------------------------------------------------------


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def describe_os_error(exc: OSError) -> str:
    """``address already in use``, ``connection refused``: strerror, lower-cased, no errno."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    text = exc.strerror or str(exc) or type(exc).__name__
    text = text[:1].lower() + text[1:]
    if exc.filename:
        text = f"{exc.filename}: {text}"
    return text


def message_for(exc: BaseException, target: str) -> tuple[str, int] | None:
    """The one line and exit code for an expected error, None for a bug."""
    if isinstance(exc, UserError):
        return str(exc), exc.code
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{target}: TLS certificate not trusted: {exc.verify_message}", EXIT_FAILURE
    if isinstance(exc, OSError) and exc.__cause__ is not None:
        # trio's "all attempts to connect failed": the first attempt's error says why.
        causes = [c for c in _leaves(exc.__cause__) if isinstance(c, OSError)]
        if causes:
            exc = causes[0]
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot connect to {target}: connection refused (nothing listens there)", \
            EXIT_FAILURE
    if isinstance(exc, OSError):
        return f"cannot connect to {target}: {describe_os_error(exc)}", EXIT_FAILURE
    if isinstance(exc, trio.TooSlowError):
        return f"{target}: no answer in time", EXIT_FAILURE
    if isinstance(exc, trio.BrokenResourceError):
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLError):
            return f"{target}: TLS handshake failed: {cause.reason or cause}", EXIT_FAILURE
        return f"{target}: connection lost", EXIT_FAILURE
    if isinstance(exc, trio.ClosedResourceError | EOFError):
        return f"{target}: connection closed", EXIT_FAILURE
    return None


def run(prog: str, async_fn: Callable[..., Coroutine[Any, Any, int]], *args: Any,
        target: str = "", errors: Callable[[BaseException], str | None] | None = None) -> int:
    """``trio.run(async_fn, *args)`` with the tools' rules for errors and Ctrl-C.

    ``target`` (``host:port``) names the peer in network errors; ``errors``
    maps a tool's own exception types to their one line (None: not one of
    mine).  Returns the exit code.
    """
    try:
        return trio.run(async_fn, *args)
    except BaseException as exc:
        return report(prog, exc, target, errors)


def report(prog: str, exc: BaseException, target: str = "",
           errors: Callable[[BaseException], str | None] | None = None) -> int:
    """Print the one line for ``exc`` (a group is reduced to its first real cause)."""
    leaves = _leaves(exc)
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        return EXIT_INTERRUPTED
    if any(isinstance(leaf, BrokenPipeError) for leaf in leaves):
        # stdout went away (`skan sub chat | head`): stop quietly, as cat does.
        _silence_stdout()
        return EXIT_FAILURE
    for leaf in leaves:
        if isinstance(leaf, SystemExit):
            raise leaf
        own = errors(leaf) if errors is not None else None
        if own is not None:
            _say(prog, own)
            return EXIT_FAILURE
        known = message_for(leaf, target)
        if known is not None:
            _say(prog, known[0])
            return known[1]
    if os.environ.get("SKAN_DEBUG") == "1":
        raise exc
    first = leaves[0]
    _say(prog, f"unexpected error ({type(first).__name__}: {first}); this is a bug, please "
               "report it (SKAN_DEBUG=1 shows the traceback)")
    return EXIT_BUG


def _say(prog: str, line: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):
        print(f"{prog}: {line}", file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    # Point stdout at /dev/null so the interpreter's final flush does not fail again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def out(line: str) -> None:
    """One line to stdout, flushed (subscribers are read line by line by scripts)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """A status line on stderr, flushed: '# ...' lines are for people, stdout is for data."""
    print(f"# {line}", file=sys.stderr, flush=True)
