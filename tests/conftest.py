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
