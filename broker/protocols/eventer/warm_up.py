"""The Chatter schemas compiled aside once a broker is up, not at its first Chatter peer.

``wire/chatter/sbs.py`` compiles hat-sbs's schemas on first use (its import
and the parse took 0.45 s of every start).  A broker with an Eventer
listener or bridge brings that forward to a worker thread right after
start-up (``BrokerContext.after_start``).
"""

from __future__ import annotations

import trio

from broker.serving.context import BrokerContext
from wire.chatter.sbs import compile_schemas


async def compile_schemas_aside() -> None:
    """Compile the Chatter schemas in a worker thread (an ``after_start`` task of
    the Eventer listener and bridges): built on first use otherwise, in the
    routing thread, which would stall every connection for 0.2-0.3 s.  A stop
    does not wait for it (the thread is left to finish; nothing depends on it)."""
    await trio.to_thread.run_sync(compile_schemas, abandon_on_cancel=True)


def warm_up(ctx: BrokerContext) -> None:
    """Have the broker compile the Chatter schemas once it is up (once per broker)."""
    if compile_schemas_aside not in ctx.after_start:
        ctx.after_start.append(compile_schemas_aside)
