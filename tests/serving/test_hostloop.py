"""The host loop (broker/serving/hostloop.py): trio as the guest of the main
thread's epoll loop, and sockets served from that loop between reads.

Each test runs a small trio program under a real HostLoop over real sockets:
trio's own scheduling (sleeps, nurseries, events) must work as under
trio.run; a served socket's step runs from the loop until it returns a
value or raises, and the socket goes back to the caller then, on
cancellation, and when the step cancels its own caller.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import trio

from broker.serving import hostloop
from broker.serving.hostloop import HostLoop


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, b


def test_a_trio_program_runs_to_its_result_or_its_exception():
    async def main(x: int) -> int:
        assert hostloop.current() is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 0.01)
        await trio.sleep(0.01)
        return x * 2

    assert HostLoop().run(main, 21) == 42
    assert hostloop.current() is None  # outside any run

    async def fails() -> None:
        await trio.sleep(0)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        HostLoop().run(fails)


def test_plain_trio_run_has_no_host_loop():
    async def main() -> object:
        return hostloop.current()

    assert trio.run(main) is None


def test_a_served_socket_is_read_by_its_step_until_the_step_returns_a_value():
    writer, reader = _pair()
    host = HostLoop()
    reads: list[bytes] = []

    def step() -> object:
        data = os.read(reader.fileno(), 1024)
        reads.append(data)
        return data if data == b"last" else None

    def publish() -> None:
        for chunk in (b"one", b"two", b"last"):
            time.sleep(0.02)  # one read each
            writer.send(chunk)

    async def main() -> object:
        threading.Thread(target=publish, daemon=True).start()
        return await host.serve(reader.fileno(), step)

    assert host.run(main) == b"last"
    assert reads == [b"one", b"two", b"last"]
    assert host.hot_reads == 3
    writer.close()
    reader.close()


def test_what_a_step_raises_reaches_its_caller_and_the_socket_is_given_back():
    writer, reader = _pair()
    host = HostLoop()
    calls = []

    def step() -> object:
        calls.append(os.read(reader.fileno(), 1024))
        raise ConnectionResetError("reset by peer")

    async def main() -> None:
        writer.send(b"x")
        with pytest.raises(ConnectionResetError):
            await host.serve(reader.fileno(), step)
        # No longer watched: more data does not run the step again.
        writer.send(b"y")
        await trio.sleep(0.05)

    host.run(main)
    assert calls == [b"x"]
    writer.close()
    reader.close()


def test_cancelling_the_caller_takes_the_socket_back_and_it_can_be_served_again():
    writer, reader = _pair()
    host = HostLoop()
    seen = []

    def step() -> object:
        seen.append(os.read(reader.fileno(), 1024))
        return True

    async def main() -> object:
        with trio.move_on_after(0.05):
            await host.serve(reader.fileno(), lambda: pytest.fail("nothing was sent"))
        # While nobody serves it, data waits in the socket: no step runs.
        writer.send(b"later")
        await trio.sleep(0.05)
        assert seen == []
        return await host.serve(reader.fileno(), step)

    assert host.run(main) is True
    assert seen == [b"later"]
    writer.close()
    reader.close()


def test_a_step_that_cancels_its_own_caller_is_not_woken_twice():
    """A connection killed while its own read is routed (a slow consumer of its
    own messages): the cancellation wakes the caller, the step's value is dropped."""
    writer, reader = _pair()
    host = HostLoop()

    async def main() -> str:
        with trio.CancelScope() as scope:

            def step() -> object:
                os.read(reader.fileno(), 1024)
                scope.cancel()
                return "routed"

            writer.send(b"x")
            await host.serve(reader.fileno(), step)
        assert scope.cancelled_caught
        await trio.sleep(0.01)  # trio goes on normally
        return "done"

    assert host.run(main) == "done"
    writer.close()
    reader.close()


def test_a_step_may_wake_trio_tasks():
    """trio's synchronous API from a step (between trio's ticks): the woken task runs."""
    writer, reader = _pair()
    host = HostLoop()

    async def main() -> float:
        got = trio.Event()

        def step() -> object:
            os.read(reader.fileno(), 1024)
            got.set()
            return None

        async with trio.open_nursery() as nursery:
            nursery.start_soon(host.serve, reader.fileno(), step)
            await trio.sleep(0.02)
            sent = time.monotonic()
            writer.send(b"x")
            with trio.fail_after(5):
                await got.wait()
            nursery.cancel_scope.cancel()
        return time.monotonic() - sent

    assert host.run(main) < 1.0
    writer.close()
    reader.close()


def test_trio_timers_and_threads_keep_working_while_sockets_are_served():
    writer, reader = _pair()
    host = HostLoop()

    async def main() -> list:
        out = []

        def step() -> object:
            os.read(reader.fileno(), 1024)
            return None

        async with trio.open_nursery() as nursery:
            nursery.start_soon(host.serve, reader.fileno(), step)
            for _ in range(5):
                writer.send(b"x")
                await trio.sleep(0.01)
                out.append(await trio.to_thread.run_sync(lambda: 7))
            nursery.cancel_scope.cancel()
        return out

    assert host.run(main) == [7] * 5
    assert host.hot_reads >= 1
    writer.close()
    reader.close()


@pytest.mark.parametrize("host_loop", [True, False])
async def test_a_broker_routes_isolated_messages_from_its_host_loop(host_loop):
    """A real broker: with ``[broker] host_loop`` (the default) the reads after
    the handshake are served from the loop (counted); with it off, none is,
    and the messages arrive the same."""
    from clients.skan import SkanClient
    from tests.brokerproc import BrokerProcess
    from tests.observability.metrics.httpc import scrape, value

    config = "" if host_loop else "[broker]\nhost_loop = false\n"
    with BrokerProcess(config) as broker:
        async with SkanClient.connect(*broker.skan) as sub, \
                SkanClient.connect(*broker.skan) as pub:
            await sub.subscribe("g")
            before = value(await scrape(broker.addr["metrics"]), "skan_host_loop_reads_total")
            for i in range(20):
                await pub.send("g", f"m{i}")  # one write each
                await trio.sleep(0.002)
            with trio.fail_after(10):
                got = [(await sub.receive()).msg for _ in range(20)]
            assert got == [f"m{i}".encode() for i in range(20)]
            reads = value(await scrape(broker.addr["metrics"]), "skan_host_loop_reads_total")
        # (Reads, not messages: two writes may arrive in one read.)
        if host_loop:
            assert reads > before
        else:
            assert reads == 0


_CTRL_C_PROGRAM = """
import os, signal, threading, trio
from broker.serving.hostloop import HostLoop
cleaned = []
async def main():
    # Sent once the run is up (trio's handler installed), while the loop waits.
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        await trio.sleep_forever()
    finally:
        cleaned.append(True)
try:
    HostLoop().run(main)
except KeyboardInterrupt:
    print("KeyboardInterrupt", cleaned)
"""


def test_ctrl_c_while_the_loop_waits_reaches_trio_as_under_trio_run():
    """SIGINT with the loop blocked in epoll_wait: trio raises KeyboardInterrupt
    in its main task (its cleanup runs), and run() raises it.  In a child
    process: a run that ended badly would leave trio's run state behind."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CTRL_C_PROGRAM], capture_output=True,
                         text=True, timeout=30, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "KeyboardInterrupt [True]", out.stderr
