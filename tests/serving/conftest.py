"""Fixtures for the two cluster tests still in this folder (test_soak.py,
test_model_families_cluster.py); the others are in tests/cluster/."""

from __future__ import annotations

import pytest

from tests.support.cluster import Cluster, start_cluster

__all__ = ["start_cluster"]


@pytest.fixture
def served(cluster: Cluster):
    yield cluster
    cluster.wait_idle(3.0)
