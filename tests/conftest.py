from __future__ import annotations

import pytest

from tests.brokerproc import BrokerProcess


@pytest.fixture(scope="module")
def broker():
    """A broker process with default settings, shared by the tests of one module."""
    with BrokerProcess() as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, "".join(proc.stderr_lines[-40:])


@pytest.fixture
def fresh_broker():
    """A broker process of its own, for tests that disturb global state."""
    with BrokerProcess() as proc:
        yield proc


# No test may hang the suite: every async test runs under a deadline.
TEST_DEADLINE = 90.0


def pytest_collection_modifyitems(items):
    import functools
    import inspect

    import trio

    for item in items:
        fn = getattr(item, "obj", None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            continue

        def wrap(fn):
            @functools.wraps(fn)
            async def deadline(*args, **kwargs):
                with trio.fail_after(TEST_DEADLINE):
                    return await fn(*args, **kwargs)

            return deadline

        item.obj = wrap(fn)
