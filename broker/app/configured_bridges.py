"""The ``bridges`` service: start every ``[[bridges]]`` entry with its protocol's runner.

A runner is ``async def run(ctx, cfg, status)``: it attaches its routing
endpoint, appends nothing (``status`` is already in ``ctx.bridges``) and
runs until cancelled, normally as ``Bridge.run`` (:mod:`broker.serving.bridge_runner`).
Bridge kinds register by adding one entry to :data:`RUNNERS`.

Each bridge runs in its own nursery under a guard: an unexpected exception
in one bridge is logged, shown in its status and the bridge is restarted
after its ``backoff_max``; the other bridges and the listeners never notice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from broker.protocols.eventer.eventer_bridge import run_eventer_bridge
from broker.protocols.hsp.hsp_bridge import run_hsp_bridge
from broker.protocols.mariner.mariner_bridge import run_mariner_bridge
from broker.serving.bridge_runner import BridgeStatus, bridge_name
from broker.serving.config import BridgeSection
from broker.serving.context import BrokerContext

log = logging.getLogger(__name__)

BridgeRunner = Callable[[BrokerContext, BridgeSection, BridgeStatus], Awaitable[None]]

# protocol -> runner.
RUNNERS: dict[str, BridgeRunner] = {
    "hsp": run_hsp_bridge,
    "mariner": run_mariner_bridge,
    "eventer": run_eventer_bridge,
}


async def _guarded(runner: BridgeRunner, ctx: BrokerContext, cfg: BridgeSection,
                   status: BridgeStatus) -> None:
    while True:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runner, ctx, cfg, status)
            return
        except Exception as exc:  # a bug in one bridge must not stop the others
            status.up = False
            status.last_error = f"internal error: {_innermost(exc)!r}"
            log.exception("bridge %s failed; restarting in %.1fs", status.name, cfg.backoff_max)
        await trio.sleep(cfg.backoff_max)
        status.reconnects += 1


def _innermost(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (for a readable status)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def serve_bridges(ctx: BrokerContext, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    todo = []
    for index, cfg in enumerate(ctx.config.bridges):
        status = BridgeStatus(bridge_name(index, cfg), cfg.protocol, cfg.address)
        ctx.bridges.append(status)
        runner = RUNNERS.get(cfg.protocol)
        if runner is None:
            status.last_error = f"no bridge implementation for protocol {cfg.protocol!r}"
            log.error("bridge %s: %s", status.name, status.last_error)
            continue
        todo.append((runner, cfg, status))
    async with trio.open_nursery() as nursery:
        for runner, cfg, status in todo:
            nursery.start_soon(_guarded, runner, ctx, cfg, status)
        task_status.started([])
