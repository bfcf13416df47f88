"""Profiles the engine on this machine: the numbers the planner simulates with.

For each torch thread count it times real engine steps (prefill-only steps
of several prompt lengths, decode steps of several batch sizes and
contexts, and a few mixed steps) and fits :class:`bench.plan.costmodel.StepCost`
to them. It also records the KV bytes per token and the KV transfer
bandwidth: from ``bench.micro.transfer`` (the real sender and receiver over
ZeroMQ, this model's KV layout), else a raw ZeroMQ loopback measurement.

Steps are timed as the engine runs them (schedule, run, update) through the
engine's public ``scheduler`` and ``runner``, so each sample knows exactly
which chunks it computed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.plan.costmodel import (
    AllReduceCost,
    StepCost,
    StepSample,
    TransferCost,
    decode_keys,
    fit_error,
    fit_step_cost,
    prefill_pairs,
    split_step_cost,
)
from engine.config import Dtype, EngineConfig


@dataclass(frozen=True)
class ProfileGrid:
    prefill_lengths: tuple[int, ...] = (32, 256, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 8, 24)
    decode_contexts: tuple[int, ...] = (64, 384)
    decode_steps: int = 6
    repeats: int = 3
    long_context: int = 2048  # decodes next to one sequence this long (padded batches)

    @classmethod
    def quick(cls) -> ProfileGrid:
        return cls((16, 64, 128), (1, 4), (16, 64), 3, 1, 256)


PROFILE_FORMAT = 2  # 2: prompt attention as the engine computes it, decode keys read apart (costmodel)


@dataclass
class Profile:
    """What the planner needs to know about one model on one machine."""

    model: str
    dtype: str
    device: str
    num_layers: int
    kv_bytes_per_token: int
    step_costs: dict[int, StepCost]  # by torch thread count
    fit_errors: dict[int, float]
    transfer_bandwidth: float  # bytes/s
    transfer_latency: float  # s
    transfer_source: str
    samples: dict[int, list[StepSample]] = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    hidden_bytes: int = 0  # one token's hidden state (what a tensor-parallel all-reduce sums per token)
    allreduce: AllReduceCost | None = None  # measured between two ranks (measure_allreduce); None: not measured
    allreduce_source: str = ""

    def cost(self, threads: int, tp: int = 1) -> StepCost:
        """The cost at ``threads`` (per rank), or at the nearest profiled count below it, on ``tp`` ranks."""
        known = sorted(self.step_costs)
        below = [t for t in known if t <= threads]
        cost = self.step_costs[below[-1] if below else known[0]]
        if tp == 1:
            return cost
        if self.allreduce is None or not self.hidden_bytes:
            raise ValueError("this profile has no all-reduce measurement for tensor parallelism: profile again")
        return split_step_cost(cost, tp, self.allreduce, self.num_layers, self.hidden_bytes)

    def transfer_cost(self, layerwise: bool = True, bandwidth: float | None = None) -> TransferCost:
        return TransferCost(
            self.kv_bytes_per_token,
            bandwidth or self.transfer_bandwidth,
            self.transfer_latency,
            self.num_layers,
            layerwise,
        )

    def to_json(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "num_layers": self.num_layers,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "step_costs": {str(t): c.to_json() for t, c in self.step_costs.items()},
            "fit_errors": {str(t): e for t, e in self.fit_errors.items()},
            "transfer": {
                "bandwidth": self.transfer_bandwidth,
                "latency": self.transfer_latency,
                "source": self.transfer_source,
            },
            "samples": {
                str(t): [[s.new_tokens, s.attn_pairs, s.seqs, s.seconds, s.decode_keys] for s in ss]
                for t, ss in self.samples.items()
            },
            "machine": self.machine,
            "hidden_bytes": self.hidden_bytes,
            "allreduce": None
            if self.allreduce is None
            else {**asdict(self.allreduce), "source": self.allreduce_source},
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        if isinstance(data, dict) and "step_costs" in data and data.get("format", 1) != PROFILE_FORMAT:
            raise ValueError(
                f"profile format {data.get('format', 1)}, this pdserve reads {PROFILE_FORMAT} "
                "(attention is counted differently): profile again"
            )
        try:
            return cls(
                model=data["model"],
                dtype=data["dtype"],
                device=data["device"],
                num_layers=int(data["num_layers"]),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                step_costs={int(t): StepCost.from_json(c) for t, c in data["step_costs"].items()},
                fit_errors={int(t): float(e) for t, e in data.get("fit_errors", {}).items()},
                transfer_bandwidth=float(data["transfer"]["bandwidth"]),
                transfer_latency=float(data["transfer"]["latency"]),
                transfer_source=str(data["transfer"]["source"]),
                samples={int(t): [StepSample(*s) for s in ss] for t, ss in data.get("samples", {}).items()},
                machine=data.get("machine", {}),
                hidden_bytes=int(data.get("hidden_bytes", 0)),
                allreduce=_allreduce(data.get("allreduce")),
                allreduce_source=str((data.get("allreduce") or {}).get("source", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a pdserve profile ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {str(path)!r} is not JSON ({exc})") from None
        return cls.from_json(data)


def timed_step(engine) -> StepSample | None:
    """Runs one engine step and returns what it computed and how long it took."""
    start = time.perf_counter()
    plan = engine.scheduler.schedule()
    if not plan.chunks:
        return None
    tokens = engine.runner.run(plan, None)
    engine.scheduler.update(plan, tokens)
    seconds = time.perf_counter() - start
    new = sum(c.num_tokens for c in plan.chunks)
    pairs = prefill_pairs([(c.start, c.start + c.num_tokens) for c in plan.chunks if not c.is_decode])
    keys = decode_keys([c.start for c in plan.chunks if c.is_decode])
    seqs = sum(1 for c in plan.chunks if c.sample)
    return StepSample(new, pairs, seqs, seconds, keys)


def median_by_shape(samples: list[StepSample]) -> list[StepSample]:
    """One sample per step shape, at the median time of its repeats.

    On a shared machine a repeat can be several times slower; the median
    keeps typical contention in and drops the freak ones.
    """
    groups: dict[tuple[int, int, int], list[float]] = {}
    for s in samples:
        groups.setdefault(s.features, []).append(s.seconds)
    return [StepSample(n, a, q, statistics.median(times), k) for (n, a, q, k), times in groups.items()]


def _prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, max(4, vocab - 1), size=length)]


def measure_steps(
    engine, grid: ProfileGrid, threads: list[int], seed: int = 0, show_progress: bool = False
) -> dict[int, list[StepSample]]:
    """Prefill, decode and mixed step samples per thread count (colocated mode).

    Every scenario runs once per thread count back to back, so all counts
    see the same background load on a shared machine.
    """
    import torch

    from engine import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.hf_config.vocab_size
    limit = engine.max_model_len - 2
    counter = iter(range(10**9))
    samples: dict[int, list[StepSample]] = {t: [] for t in threads}

    def add(length: int, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"profile-{next(counter)}", _prompt(rng, min(length, limit), vocab), sampling)

    def drain(into: list[StepSample] | None) -> None:
        while engine.has_unfinished():
            sample = timed_step(engine)
            if into is not None and sample is not None:
                into.append(sample)

    def prefill(length: int, into) -> None:
        add(length, 1)
        drain(into)

    def decode(batch: int, context: int, into) -> None:
        for _ in range(batch):
            add(context, grid.decode_steps + 1)
        drain(into)  # the batched prefill steps are samples too

    def mixed(into) -> None:
        # A prompt joining a running decode batch.
        for _ in range(grid.decode_batches[-1]):
            add(grid.decode_contexts[0], grid.decode_steps + 2)
        timed_step(engine)
        add(grid.prefill_lengths[len(grid.prefill_lengths) // 2], 1)
        drain(into)

    scenarios = [lambda into, n=n: prefill(n, into) for _ in range(grid.repeats) for n in grid.prefill_lengths]
    scenarios += [lambda into, b=b, c=c: decode(b, c, into) for b in grid.decode_batches for c in grid.decode_contexts]

    def padded(into) -> None:
        # Short decodes batched with one long context: every one reads as many keys.
        add(grid.long_context, grid.decode_steps + 1)
        for _ in range(3):
            add(grid.decode_contexts[0], grid.decode_steps + 1)
        drain(into)

    scenarios.append(mixed)
    scenarios.append(padded)
    for count in threads:
        torch.set_num_threads(count)
        prefill(16, None)  # warm-up
    from tqdm import tqdm

    for scenario in tqdm(
        scenarios, desc="profiling step shapes", unit="shape", file=sys.stderr, disable=not show_progress
    ):
        for count in threads:
            torch.set_num_threads(count)
            scenario(samples[count])
    return samples


def _allreduce(data: dict | None) -> AllReduceCost | None:
    return None if data is None else AllReduceCost(float(data["latency"]), float(data["bandwidth"]))


def measure_allreduce(hidden: int, element: int, repeats: int = 20) -> AllReduceCost:
    """Two gloo ranks as two threads of this process (loopback TCP, as two rank processes of one
    host would use): the median time of all-reduces of 1, 16 and 256 tokens' hidden states, fitted
    to latency + bytes / bandwidth. On CUDA, NCCL over NVLink is far faster: measure it there."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    sizes = (1, 16, 256)
    times: dict[int, list[float]] = {n: [] for n in sizes}

    def rank(r: int) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(store, r, 2, options)
        for n in sizes:
            x = torch.ones(n * hidden * element // 4)  # float32 elements holding n tokens' bytes
            group.allreduce([x]).wait()
            for _ in range(repeats):
                start = time.perf_counter()
                group.allreduce([x]).wait()
                if r == 0:
                    times[n].append(time.perf_counter() - start)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    nbytes = np.array([n * hidden * element for n in sizes], dtype=float)
    seconds = np.array([statistics.median(times[n]) for n in sizes])
    slope, intercept = np.polyfit(nbytes, seconds, 1)
    return AllReduceCost(max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15))


def measure_zmq_transfer(message_bytes: int, count: int = 32, pings: int = 20) -> tuple[float, float]:
    """(bandwidth bytes/s, one-way latency s) over ZeroMQ on loopback TCP.

    Latency is half the median round trip of a small two-frame message;
    bandwidth is ``count`` messages of ``message_bytes`` (header + payload
    frames, as the ZeroMQ backend sends KV) until the receiver has them all.
    """
    import zmq

    ctx = zmq.Context()
    near, far = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = near.bind_to_random_port("tcp://127.0.0.1")
        far.connect(f"tcp://127.0.0.1:{port}")
        payload = np.random.default_rng(0).integers(0, 255, size=message_bytes, dtype=np.uint8).tobytes()
        header = b'{"layer": 0}'

        def peer() -> None:
            for _ in range(pings):
                far.send_multipart(far.recv_multipart())
            for _ in range(count):
                far.recv_multipart(copy=False)
            far.send(b"done")

        thread = threading.Thread(target=peer, daemon=True)
        thread.start()
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            near.send_multipart([header, b"x"])
            near.recv_multipart()
            rtts.append(time.perf_counter() - t0)
        start = time.perf_counter()
        for _ in range(count):
            near.send_multipart([header, payload], copy=False)
        near.recv()
        bandwidth = count * message_bytes / (time.perf_counter() - start)
        thread.join(timeout=10)
        return bandwidth, statistics.median(rtts[2:] or rtts) / 2
    finally:
        near.close(linger=0)
        far.close(linger=0)
        ctx.term()


def measure_transfer_bench(
    num_layers: int, kv_heads: int, head_dim: int, dtype: str, backend: str = "zmq"
) -> tuple[float, float] | None:
    """(bandwidth bytes/s, latency s) from ``bench.micro.transfer``: the real sender
    and receiver, a 512-token KV of this model's layout; None when it fails.

    Latency is its one-block (16 tokens, all layers, push to Ack) time.
    """
    cmd = [
        sys.executable,
        "-m",
        "bench.micro.transfer",
        "--backend",
        backend,
        "--json",
        "--layers",
        str(num_layers),
        "--kv-heads",
        str(kv_heads),
        "--head-dim",
        str(head_dim),
        "--dtype",
        dtype,
        "--blocks",
        "32",
        "--block-size",
        "16",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        result = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        result = None
    if not result:
        return None
    return float(result["median_gbps"]) * 1e9, float(result["one_block_ms"]) / 1000


def machine_info() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_1m": os.getloadavg()[0],
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def profile_engine(
    model: str,
    threads: list[int],
    grid: ProfileGrid = ProfileGrid(),
    dtype: Dtype = EngineConfig.dtype,
    device: str = EngineConfig.device,
    progress=print,
    bar: bool = True,
) -> Profile:
    """Measures the model at each thread count and fits the cost model; ``bar``:
    a progress bar on stderr while the step shapes are measured."""
    import torch

    from engine import EngineConfig, LLMEngine

    longest = max(grid.prefill_lengths)
    need = max(longest, max(grid.decode_batches) * max(grid.decode_contexts)) * 2 + 4096
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        num_blocks=need // 16 + 1,
        max_num_batched_tokens=max(longest, 2048),
        max_num_seqs=max(64, max(grid.decode_batches) + 2),
    )
    engine = LLMEngine(config)
    cache = engine.cache
    element = torch.tensor([], dtype=cache.dtype).element_size()
    kv_bytes = cache.num_layers * 2 * cache.num_kv_heads * cache.head_dim * element
    info = machine_info()
    start = time.perf_counter()
    all_samples = measure_steps(engine, grid, threads, show_progress=bar)
    costs, errors = {}, {}
    for count, samples in all_samples.items():
        costs[count] = fit_step_cost(median_by_shape(samples))
        errors[count] = fit_error(costs[count], samples)
        progress(f"threads={count}: {len(samples)} steps, fit error {100 * errors[count]:.1f}%: {costs[count]}")
    progress(f"profiled in {time.perf_counter() - start:.1f}s")
    measured = measure_transfer_bench(cache.num_layers, cache.num_kv_heads, cache.head_dim, dtype)
    if measured is not None:
        (bandwidth, latency), source = measured, "bench.micro.transfer zmq (median, 512 tokens)"
    else:
        bandwidth, latency = measure_zmq_transfer(kv_bytes // cache.num_layers * 512)
        source = "raw zmq loopback (bench.micro.transfer unavailable)"
    progress(f"transfer: {source}: {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e3:.2f} ms")
    hidden = engine.hf_config.hidden_size
    allreduce = measure_allreduce(hidden, element)
    progress(
        f"all-reduce (2 gloo ranks): {allreduce.bandwidth / 1e9:.2f} GB/s, latency {allreduce.latency * 1e6:.0f} us"
    )
    info["loadavg_1m_after"] = os.getloadavg()[0]
    return Profile(
        model,
        dtype,
        device,
        cache.num_layers,
        kv_bytes,
        costs,
        errors,
        bandwidth,
        latency,
        source,
        all_samples,
        info,
        hidden * element,
        allreduce,
        "gloo, 2 ranks as threads, loopback",
    )
