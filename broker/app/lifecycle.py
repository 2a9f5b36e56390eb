"""Start every service, print the ``listening`` lines, stop gracefully on a signal."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
from collections.abc import Callable
from typing import Any

import trio

from broker.app.listening import print_listening
from broker.app.reload import reload_config
from broker.app.services import services
from broker.core.router import Router
from broker.serving.config import Config, build_authenticator
from broker.serving.context import BrokerContext
from broker.serving.fdlimit import apply_descriptor_limit
from broker.serving.scheduling import set_thread_slice
from broker.serving.transport import probe_listen
from broker.store import Store
from broker.store.heap import return_large_frames

log = logging.getLogger(__name__)


class StartupError(Exception):
    """A service could not start; the message names it and its address or file."""

    @classmethod
    def of(cls, name: str, config: Config, exc: OSError) -> StartupError:
        reason = exc.strerror or str(exc)
        reason = reason[:1].lower() + reason[1:]
        section = getattr(config, name, None)
        if section is None or not hasattr(section, "port"):
            return cls(f"cannot start {name}: {reason}")
        host = getattr(section, "host", None) or config.broker.host
        where = f"{name} listener on {host}:{section.port}"
        for key in ("tls_cert", "tls_key"):
            path = getattr(section, key, None)
            if path and (exc.filename == path or not os.access(path, os.R_OK)):
                return cls(f"cannot start {where}: {name}.{key} {path}: {reason}")
        if isinstance(exc, ssl.SSLError):
            return cls(f"cannot start {where}: TLS certificate or key refused: {exc}")
        return cls(f"cannot start {where}: {reason}")


def new_router(config: Config) -> Router:
    """The router; in a cluster its lnames name this broker (``HOST/SERVER_ID``)."""
    b = config.broker
    limits = {"max_subscriptions": b.max_subscriptions, "max_frame": b.max_frame}
    if config.cluster.enabled:
        return Router(hostname=f"{socket.gethostname()}/{b.server_id}", server_id=b.server_id,
                      **limits)
    return Router(server_id=b.server_id, **limits)


# Services that listen on a port of their own config section.
LISTENING_SERVICES = ("skan", "hsp", "eventer", "mariner", "metrics")


async def _probe_ports(config: Config, names: tuple[str, ...]) -> None:
    """Every listener's port can be bound, checked before any service starts:
    the routing log and the store create their directories as they start, and
    a broker that cannot listen must leave nothing behind."""
    for name in LISTENING_SERVICES:
        if name not in names:
            continue
        section = getattr(config, name)
        host = getattr(section, "host", None) or config.broker.host
        reuse = config.broker.reuse_port and name != "metrics"
        try:
            await probe_listen(host, section.port, reuse_port=reuse)
        except OSError as exc:
            raise StartupError.of(name, config, exc) from exc


# Seconds the drain may still take once a second stop signal arrived: the
# operator (or a supervisor escalating) wants out now; the final commit of
# the store and the routing log's flush still happen, only the wait for
# slow connections' queues is cut short.
HURRIED_DRAIN = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP from the moment the broker is ready until it exits.

    The first SIGINT/SIGTERM starts a graceful stop; a second one cuts the
    drain short (:data:`HURRIED_DRAIN`); a third aborts at once, without the
    final commit (exit status 128 + the signal, like a default handler).
    SIGHUP reloads the configuration while running and is ignored once a
    stop has begun.  Plain Python handlers, not a trio signal receiver, so
    that they keep working while the process does the blocking final commit
    after the trio tasks are gone, and nothing is left pending at exit for
    a default handler to act on.  The handlers only count and hand the work
    to the trio thread (``TrioToken.run_sync_soon``, safe in a signal
    handler).
    """

    def __init__(self, ctx: BrokerContext, stop: trio.Event) -> None:
        self.ctx = ctx
        self.stop = stop
        self.count = 0
        self.token = trio.lowlevel.current_trio_token()
        # The drain's cancel scope while connections drain (a second signal
        # moves its deadline in).
        self.drain: trio.CancelScope | None = None
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (*STOP_SIGNALS, signal.SIGHUP):
            self._saved[signum] = signal.signal(signum, self._handler)

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()

    def _handler(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            self._soon(self._reload, signum)
            return
        self.count += 1
        if self.count >= 3:
            name = signal.Signals(signum).name
            with contextlib.suppress(OSError):
                os.write(2, f"skan-broker: received {name} a third time: exiting at once, "
                            "without the final commit of the store and the routing log\n"
                         .encode())
            os._exit(128 + signum)
        self._soon(self._stopping if self.count == 1 else self._hurry, signum)

    def _soon(self, fn: Callable[[int], None], signum: int) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(fn, signum)

    def _reload(self, signum: int) -> None:
        if self.count or self.stop.is_set():
            self._ignored(signum)
            return
        try:
            reload_config(self.ctx)
        except Exception:  # never into trio's run loop (run_sync_soon)
            log.exception("reload failed")

    def _stopping(self, signum: int) -> None:
        log.info("received %s, stopping (a second signal shortens the drain)",
                 signal.Signals(signum).name)
        self.stop.set()

    def _hurry(self, signum: int) -> None:
        log.warning("received %s again: cutting the drain short; the store's final commit "
                    "and the routing log's flush still happen (a third signal aborts)",
                    signal.Signals(signum).name)
        self.stop.set()
        if self.drain is not None:
            self.drain.deadline = min(self.drain.deadline, trio.current_time() + HURRIED_DRAIN)

    def _ignored(self, signum: int) -> None:
        log.info("received %s while stopping: ignored", signal.Signals(signum).name)


async def run(
    config: Config,
    *,
    ready: Callable[[list[str]], None] = print_listening,
    stop: trio.Event | None = None,
    ctx_out: list[BrokerContext] | None = None,
    reload: Callable[[], Config] | None = None,
) -> None:
    """Run the broker until SIGINT/SIGTERM (or ``stop`` is set), then drain and return.

    SIGHUP calls ``reload`` for a fresh configuration and applies it (see
    :mod:`broker.app.reload`); signals during a stop: :class:`StopSignals`.
    """
    config = apply_descriptor_limit(config)
    return_large_frames()
    enabled = [(name, serve) for name, is_enabled, serve in services() if is_enabled(config)]
    ctx = BrokerContext(config=config, router=new_router(config),
                        services=tuple(name for name, _ in enabled), reload=reload)
    ctx.router.enforcer.auth = build_authenticator(config)
    signals = StopSignals(ctx, trio.Event() if stop is None else stop)
    try:
        await _run(config, ctx, enabled, ready, signals, ctx_out)
    finally:
        try:
            if isinstance(ctx.retention, Store):
                # Commit what is queued (a graceful stop loses nothing).
                ctx.retention.close()
        finally:
            signals.restore()


async def _run(config: Config, ctx: BrokerContext, enabled: list,
               ready: Callable[[list[str]], None], signals: StopSignals,
               ctx_out: list[BrokerContext] | None) -> None:
    if ctx_out is not None:
        ctx_out.append(ctx)
    stop = signals.stop
    await _probe_ports(config, ctx.services)
    async with trio.open_nursery() as outer:
        ctx.conn_nursery = outer
        async with trio.open_nursery() as svc_nursery:
            lines = []
            for name, serve in enabled:
                try:
                    addrs = await svc_nursery.start(serve, ctx)
                except OSError as exc:
                    raise StartupError.of(name, config, exc) from exc
                log.info("service %s started", name)
                lines += [f"listening {proto} {host}:{port}" for proto, host, port in addrs]
            # Stop signals are handled before anyone hears the broker is
            # ready: a supervisor's SIGTERM right after the listening lines
            # is a graceful stop, not the default handler's abrupt exit.
            signals.install()
            # Routing's lateness, for the writers that go idle (scheduling.py).
            svc_nursery.start_soon(ctx.stall_watch.run)
            # Everything allocated during start-up lives as long as the process:
            # move it out of the collector's way so full collections stay short.
            gc.collect()
            gc.freeze()
            if config.broker.routing_slice:
                set_thread_slice(config.broker.routing_slice)
            # Ready once start-up is done: whoever reads the lines next (a
            # supervisor, a test) finds the broker as configured.
            ready(lines)
            for task in ctx.after_start:
                svc_nursery.start_soon(task)
            await stop.wait()
            # 1. no new connections, bridges stop
            svc_nursery.cancel_scope.cancel()
        # 2. tell peers, then drain every connection's queue and close it
        for hook in ctx.on_stopping:
            try:
                hook()
            except Exception:
                log.exception("stopping hook failed")
        ctx.connections.stop_all()
        with trio.move_on_after(config.broker.drain_timeout + 1) as drain:
            signals.drain = drain
            if signals.count > 1:  # the second signal came before the drain began
                drain.deadline = min(drain.deadline, trio.current_time() + HURRIED_DRAIN)
            while len(ctx.connections):
                await trio.sleep(0.01)
        signals.drain = None
        outer.cancel_scope.cancel()
    # 3. flush what must survive the process (routing log); the store's final
    # commit follows in run()
    for hook in ctx.on_stopped:
        with trio.CancelScope(shield=True):
            await hook()
