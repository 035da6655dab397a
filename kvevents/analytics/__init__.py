"""Analytics over a kvevents topic: Parquet export (one row per block event), the cache report,
and the Spark Structured Streaming job that writes the same layout at scale.

Design and recipes: ``docs/ANALYTICS.md``. Needs the ``analytics`` extra (pyarrow, duckdb);
the Spark job needs the ``spark`` extra.
"""
