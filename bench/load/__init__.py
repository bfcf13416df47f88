"""Load generation against any OpenAI-compatible endpoint, and its measurement.

``pdserve bench serve`` (serve.py) builds a workload (workload.py, prefix_workload.py,
prompts.py), sends it (loadgen.py) and reports TTFT, TPOT, ITL, E2E and goodput
(metrics.py, report.py; timeline.py for pdserve's own per-stage timings). cluster.py
starts and stops a local pdserve cluster for the benchmarks above this package to load.
Imports nothing else from bench: the other subpackages build on it.
"""
