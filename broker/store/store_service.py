"""The ``store`` service: open the durable store (or the in-memory ring) before the listeners.

It runs right after the routing log (so an unusable log directory is
reported as such first) and before anything can route: the store continues
the router's session numbering from what it reserved before.  The broker
closes it after connections have drained (``broker.app.lifecycle``), so a
graceful stop commits everything.
"""

from __future__ import annotations

import functools
import logging
import time

import trio

from broker.core.retention import RetentionStore
from broker.core.router import Router
from broker.serving.config import Config
from broker.serving.context import BrokerContext
from broker.serving.scheduling import Background, lower_thread_priority
from broker.store.store import Store, default_dir
from broker.store.writer_process import ProcessStore

log = logging.getLogger(__name__)


def open_retention(config: Config, router: Router) -> Store | RetentionStore:
    """The durable store, or the in-memory ring when ``[store] enabled = false``.

    A store that cannot be used raises StoreError (an OSError naming the path
    and the reason) before anything listens: never silently emptied.
    """
    ret = config.retention
    if not config.store.enabled:
        ring = RetentionStore(ret.size, ret.max_bytes, ret.max_age)
        ring.attach(router)
        return ring
    directory = config.store.dir or default_dir(config.log.dir)
    started = time.monotonic()
    process = config.store.writer == "process"
    cls = ProcessStore if process else Store
    store = cls(directory, size=ret.size, max_bytes=ret.max_bytes, max_age=ret.max_age,
                flush_interval=config.store.flush_interval,
                spool_max_bytes=config.store.spool_max_bytes)
    store.attach(router)
    call_soon = trio.lowlevel.current_trio_token().run_sync_soon
    nice = config.broker.writer_nice
    if process:
        # The SQLite work runs in the child at writer_nice; the shipping
        # thread here only hands batches over (and waits on the pipe).
        store.start(call_soon, functools.partial(lower_thread_priority, nice), nice=nice)
    else:
        store.background = Background(nice, config.broker.writer_idle, "store writer")
        store.start(call_soon, store.background.setup)
    log.info("store %s opened in %.3fs: %d retained messages, continuing at session %d "
             "(writer: %s)", store.path, time.monotonic() - started, store.count,
             router.session, config.store.writer)
    return store


async def serve_store(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    ctx.retention = store = open_retention(ctx.config, ctx.router)
    background = getattr(store, "background", None)
    if isinstance(store, Store) and background is not None:
        # Whether an idle writer still commits, at the stall watch's pace
        # (scheduling.StallWatch): one that committed nothing between two
        # checks while operations waited is starved by other work on the
        # machine and gets its nice value back (StoreWriter.check_progress).
        # That bounds what a power loss can take while the writer is starved
        # (flush_interval otherwise), at a trio timer (a thread hand-over
        # under the host loop) five times a second.
        ctx.stall_watch.add(background, store.check_progress)
    task_status.started([])
