"""The Grafana dashboard in deploy/grafana/ charts what a running cluster exports:
every metric its queries name is a family on the router's or a server's /metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.cluster import REPO

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "deploy" / "grafana" / "pdserve-dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def family(sample_name: str) -> str:
    for suffix in SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def samples(url: str) -> set[str]:
    """The names of the samples ``url``'s /metrics holds now (labels dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


def exported(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family(line.split()[2]) for line in text.splitlines() if line.startswith("# TYPE ")}


def test_every_dashboard_query_names_metrics_the_cluster_exports(one_p_one_d):
    c = one_p_one_d
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [t["expr"] for p in panels for t in p["targets"]]
    # Every counter a query rates has samples, each known label value at 0 until its first event.
    counters = {m for q in queries for m in re.findall(r"\bpdserve_[a-z0-9_]+_total\b", q)}
    before = samples(c.router_url).union(*(samples(s["url"]) for s in c.servers))
    assert "pdserve_transfer_failures_total" in counters and sorted(counters - before) == []
    c.client().completions.create(model="tiny", prompt="hello there, a request to fill histograms", max_tokens=3)
    families = exported(c.router_url).union(*(exported(s["url"]) for s in c.servers))
    named = {family(m) for q in queries for m in re.findall(r"\bpdserve_[a-z0-9_]+", q)}
    assert len(panels) >= 8 and len(named) >= 15
    missing = sorted(named - families)
    assert missing == [], missing
