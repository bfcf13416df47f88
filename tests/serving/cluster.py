"""Moved to tests/support/cluster.py; kept for the modules still in this folder."""

from tests.support.cluster import Cluster, make_config

__all__ = ["Cluster", "make_config"]
