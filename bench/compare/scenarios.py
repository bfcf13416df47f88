"""The workloads ``bench compare`` runs, and the clusters it runs them on.

Sized for the project's ~90M benchmark model in float32 on a 2-core CPU
(a 2048-token prefill takes seconds there); ``scale`` multiplies the
request counts, ``rates`` overrides arrival rates by scenario name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.load.workload import Workload
from bench.plan.plan import Candidate
from engine.config import EngineConfig


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: Workload
    num_requests: int
    rate: float | None = None  # Poisson; None: closed loop at ``concurrency``
    concurrency: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    idle: bool = False  # one request at a time: TTFT without queueing
    rounds: int = 2  # parts sent to the layouts in turn (ABBA), so drift hits both alike


def default_scenarios() -> tuple[Scenario, ...]:
    return (
        Scenario(
            "prefill-heavy",
            "2048-token prompts (20%) arrive while short requests decode 96 tokens; tight TPOT SLO",
            Workload.mix(["0.2:2048:16", "0.8:uniform(32,128):96"]),
            num_requests=40,
            rate=0.25,
            slo_ttft_ms=20000,
            slo_tpot_ms=100,
        ),
        Scenario(
            "short",
            "short prompts and answers only: nothing to disaggregate, half the cores per engine",
            Workload.single("uniform(16,64)", "64"),
            num_requests=40,
            rate=1.0,
            slo_ttft_ms=2000,
            slo_tpot_ms=100,
        ),
        Scenario(
            "idle-2k",
            "one 2048-token prompt at a time on an idle cluster: TTFT and the transfer it hides",
            Workload.single("2048", "4"),
            num_requests=3,
            concurrency=1,
            idle=True,
            rounds=3,
        ),
    )


def select(names: str | None, scale: float = 1.0, rates: dict[str, float] | None = None) -> list[Scenario]:
    known = {s.name: s for s in default_scenarios()}
    wanted = [n.strip() for n in names.split(",")] if names else list(known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}: choose from {sorted(known)}")
    rates = rates or {}
    bad = sorted(set(rates) - set(wanted))
    if bad:
        raise ValueError(f"--rate given for scenario(s) not run: {bad}")
    out = []
    for name in wanted:
        s = known[name]
        n = s.num_requests if s.idle else max(1, round(s.num_requests * scale))
        out.append(replace(s, num_requests=n, rate=rates.get(name, s.rate)))
    return out


def parse_rates(items: list[str] | None) -> dict[str, float]:
    """``NAME=R`` items."""
    out = {}
    for item in items or []:
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"bad --rate {item!r}: use NAME=REQ_PER_S, e.g. prefill-heavy=0.3") from None
        if out[name.strip()] <= 0:
            raise ValueError(f"bad --rate {item!r}: must be > 0")
    return out


@dataclass(frozen=True)
class EngineKnobs:
    """Engine settings written into both generated configs."""

    block_size: int = EngineConfig.block_size
    kv_cache_bytes: int = EngineConfig.kv_cache_bytes
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    # Off for the sweep: every rate sends the same prompts, and a cache hit would skip their prefill.
    prefix_caching: bool = EngineConfig.prefix_caching


def cluster_config(
    cand: Candidate, model: str, ports: list[int], knobs: EngineKnobs, prefill_threads: int | None = None
) -> dict:
    """A cluster YAML (as a dict) for ``pdserve launch``.

    ``ports``: one for the router, then one per instance (its KV port is the
    next one). ``prefill_threads`` overrides the prefill servers' threads
    (the idle-TTFT run gives P every core, as the colocated engine has).
    """
    if len(ports) < 1 + cand.instances:
        raise ValueError(f"{cand.name} needs {1 + cand.instances} ports, got {len(ports)}")
    engine = {
        "num_threads": cand.threads,
        "block_size": knobs.block_size,
        "kv_cache_bytes": knobs.kv_cache_bytes,
        "max_num_seqs": knobs.max_num_seqs,
        "max_num_batched_tokens": knobs.max_num_batched_tokens,
        "prefix_caching": knobs.prefix_caching,
    }
    data: dict = {
        "model": model,
        "dtype": "float32",
        "device": "cpu",
        "engine": engine,
        "router": {"port": ports[0], "health_interval_s": 1.0},
    }
    free = iter(ports[1:])
    if cand.num_prefill == 0:
        data["colocated"] = [{"name": f"c{i}", "port": next(free)} for i in range(cand.num_serving)]
        return data
    data["transfer"] = {"backend": "zmq"}
    data["prefill"] = [{"name": f"p{i}", "port": next(free)} for i in range(cand.num_prefill)]
    if prefill_threads is not None:
        for inst in data["prefill"]:
            inst["num_threads"] = prefill_threads
    data["decode"] = [{"name": f"d{i}", "port": next(free)} for i in range(cand.num_serving)]
    return data
