from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from tests.brokerproc import ROOT, BrokerProcess
from tests.examples import LONG

# Hypothesis keeps its files (example database, constants cache) under
# .hypothesis in the working directory, the checkout: a temporary directory
# instead, unless HYPOTHESIS_STORAGE_DIRECTORY names one.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    _HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="skan-hypothesis-")
    atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, True)
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)
# `make test` tries the same inputs every run (no database, a fixed seed), so
# it cannot pass or fail by luck; `make fuzz` (SKAN_FUZZ=long) explores afresh.
# Loaded before any test module, so every @settings(...) inherits it.
settings.register_profile("make-test", derandomize=True, database=None, print_blob=True)
if not LONG:
    settings.load_profile("make-test")

# Tests write only to temporary directories.  A broker's default directories
# are relative (var/routing-log, var/store): a test that starts one in the
# checkout leaves them here, and Hypothesis would write .hypothesis.  The
# session fails if anything under either appeared or changed while it ran
# (checked after the last test, so it holds whichever tests ran, in any
# order, with or without the cache plugin).
CHECKOUT_DIRS = (ROOT / "var", ROOT / ".hypothesis")
_VAR_BEFORE = pytest.StashKey[dict]()


def _var_state() -> dict[str, int]:
    state: dict[str, int] = {}
    for top in CHECKOUT_DIRS:
        if top.exists():
            state[top.name] = 0
            state |= {str(p.relative_to(ROOT)): p.stat().st_mtime_ns for p in top.rglob("*")}
    return state


def pytest_sessionstart(session):
    session.config.stash[_VAR_BEFORE] = _var_state()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_VAR_BEFORE, None)
    if before is None:
        return
    after = _var_state()
    changed = sorted(k for k, v in after.items() if before.get(k) != v)
    if not changed:
        return
    shown = ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = (f"tests wrote into the checkout ({ROOT}): {shown}; tests must write only to "
            "temporary directories (give the broker --log-dir/--store-dir or a tmp cwd)")
    if reporter is not None:
        reporter.write_sep("=", "checkout written", red=True)
        reporter.write_line(line)
    else:
        print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED



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
        if getattr(fn, "is_hypothesis_test", False):
            # `make fuzz` runs these at their full counts (tests/examples.py).
            item.add_marker(pytest.mark.property)
        if fn is None or not inspect.iscoroutinefunction(fn):
            continue

        def wrap(fn):
            @functools.wraps(fn)
            async def deadline(*args, **kwargs):
                with trio.fail_after(TEST_DEADLINE):
                    return await fn(*args, **kwargs)

            return deadline

        item.obj = wrap(fn)
