"""Fixtures for the whole-cluster tests. Each module defines a module-scoped ``cluster``
(real processes); tests use ``served``, which checks afterwards that every server is
back to zero reserved and running KV blocks."""

from __future__ import annotations

import pytest

from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, Cluster, start_cluster


@pytest.fixture(scope="package")
def one_p_one_d(tmp_path_factory, tiny_model):
    """configs/tiny-1p1d.yaml (P block size 4, D block size 16), shared by several modules.

    Prefix caching is off here: these modules send the same prompts again and
    count the tokens each server computes (test_prefix_disaggregated.py runs
    a cluster with caching on)."""
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {
            "max_model_len": MAX_MODEL_LEN,
            "router": {"local_prefill_threshold": THRESHOLD},
            "engine": {"prefix_caching": False},
            "fault_injection": True,  # /admin/faults: a test can slow a server's steps (none by default)
        },
    )
    yield c
    c.stop()


@pytest.fixture
def served(cluster: Cluster):
    yield cluster
    cluster.wait_idle(3.0)
