"""Micro-benchmarks: what one component or one kind of request costs.

The engine against transformers (engine_bench.py, also ``pdserve bench engine``),
sampling options, log-probabilities and grammars (*_overhead.py), the router
against stub servers (router_bench.py with stubs.py and stub_cluster.py, which the
router's tests use too), KV transfer between two network namespaces
(multihost_transfer.py), and what hostile requests cost a normal client on a
live cluster (hostile.py).
"""
