"""The routing-log service: trio glue around :class:`RoutingLog` (no port).

Opens the log directory (lock, crash recovery), registers the router
observer before any listener accepts, wires back-pressure to the
connections' admission gate, hands pending records to the writer on a short
timer, and on a graceful stop (``ctx.on_stopped``) flushes everything and
publishes the last file.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from broker.observability.routelog.files import LogDirectory
from broker.observability.routelog.writer import RoutingLog
from broker.serving.context import BrokerContext
from broker.serving.scheduling import Background

log = logging.getLogger(__name__)

# How often pending records go to the writer when traffic is too light to
# fill a hand-off batch.  JSON Lines: bounds how stale the file on disk can
# be.  Parquet: records reach the file a row group at a time (the writer
# keeps the hand-offs until one is due), so the interval bounds only the
# routing thread's buffer and the lag metric; each hand-off is a timer of
# trio's (a thread hand-over under the host loop) and a wake-up of the
# writer, so it is rare.
HANDOFF_INTERVAL = {"jsonl": 0.05, "parquet": 1.0}
GATE_HOLDER = "routelog"


async def serve_routelog(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.log
    directory = LogDirectory(cfg.dir, ctx.config.broker.server_id)
    recovery = await trio.to_thread.run_sync(directory.open)
    gate = ctx.connections.gate
    token = trio.lowlevel.current_trio_token()

    def reopen() -> None:  # trio thread
        if routelog.reopen_if_drained():
            gate.open(GATE_HOLDER)

    def request_open() -> None:  # writer thread
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(reopen)

    background = Background(cfg.writer_nice, ctx.config.broker.writer_idle,
                            "routing-log writer")
    routelog = RoutingLog(
        directory,
        rotate_bytes=cfg.rotate_bytes,
        rotate_seconds=cfg.rotate_seconds,
        queue_records=cfg.queue_records,
        max_bytes=cfg.max_bytes,
        max_age=cfg.max_age,
        format=cfg.format,
        when_full=cfg.when_full,
        close_gate=lambda: gate.close(GATE_HOLDER),
        request_open=request_open,
        thread_setup=background.setup,
    )
    routelog.background = background
    ctx.stall_watch.add(background)
    routelog.recovery = recovery
    routelog.waits_source = lambda: gate.waits
    routelog.attach(ctx.router)
    routelog.start()
    ctx.routelog = routelog

    async def flush() -> None:
        queued = routelog.queued
        if queued:
            log.info("routing log: writing %d queued record(s) before exit", queued)
        routelog.stop()
        await trio.to_thread.run_sync(routelog.join)
        log.info("routing log: %d record(s) in %d file(s) in %s", routelog.stats.records,
                 routelog.stats.files, cfg.dir)

    ctx.on_stopped.append(flush)
    log.info("routing log in %s", cfg.dir)
    task_status.started([])
    interval = HANDOFF_INTERVAL[cfg.format]
    while True:
        await trio.sleep(interval)
        if routelog.failure is not None:
            # Fail-stop: a broker that cannot log would hold its input back forever.
            raise RuntimeError("the routing log writer failed") from routelog.failure
        routelog.handoff()
