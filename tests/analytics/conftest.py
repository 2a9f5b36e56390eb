from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def spark():
    """ONE local SparkSession for every analytics test (a JVM start costs seconds)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from analytics.session import build_session

    session = build_session("skan-analytics-tests", "local[2]", {
        "spark.sql.shuffle.partitions": "2",
        "spark.ui.enabled": "false",
        "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
    })
    yield session
    session.stop()
    # Spark's own output went to a temporary file (analytics.session): leave none behind.
    log = getattr(session, "skan_jvm_log", None)
    if log and os.path.exists(log):
        os.unlink(log)
