"""``skan-analytics``: PySpark jobs over the routing log (see docs/analytics.md).

``stream``: a Structured Streaming job (checkpointed, exactly-once) writing
windowed traffic per group and per protocol to Parquet.  ``report``: a batch
job printing tables and writing PNG charts plus one self-contained HTML page.
Only the DataFrame API is used (no Python UDFs), so executors need no copy of
this package and the jobs run unchanged under ``spark-submit`` on a cluster.
"""
