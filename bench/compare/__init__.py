"""Colocated vs xPyD measured on real clusters, and the planner checked against them.

``pdserve bench compare`` (compare.py) launches both layouts on the same cores, runs
scenarios (scenarios.py) through them (compare_run.py), optionally as a rate sweep
(compare_sweep.py), and writes the report (compare_report.py); sweep_replay.py
re-simulates a saved sweep. cache_sweep.py compares prefix-caching variants;
interference.py measures what colocated prefill and decode cost each other. Uses
bench.load to drive the clusters and bench.plan for the predictions.
"""
