"""`kv_cache_bytes: auto` (deploy/kv_memory.py): the host's memory read from /proc and a cgroup, shared out
over the servers one host starts, capped at what they could use, refused where too small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from deploy.config import parse_config
from deploy.kv_memory import (
    MIB,
    RANK_OVERHEAD_BYTES,
    HostMemory,
    KvMemoryError,
    ServerMemory,
    auto_kv_cache_bytes,
    model_weight_bytes,
    server_memory,
)
from engine.loader import load_model
from engine.model import Linear
from tests.support.cluster import CONFIGS

GIB = 1 << 30


def meminfo(folder: Path, total_kb: int, available_kb: int) -> Path:
    path = folder / "meminfo"
    path.write_text(f"MemTotal:       {total_kb} kB\nMemFree:        1 kB\nMemAvailable:   {available_kb} kB\n")
    return path


def test_host_memory_is_meminfo_lowered_to_a_cgroup_limit(tmp_path):
    proc = meminfo(tmp_path, 24 * 1024 * 1024, 16 * 1024 * 1024)
    no_cgroup = tmp_path / "none"
    assert HostMemory.read(proc, no_cgroup) == HostMemory(24 * GIB, 16 * GIB)
    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    (unlimited / "memory.current").write_text(str(3 * GIB))
    assert HostMemory.read(proc, unlimited) == HostMemory(24 * GIB, 16 * GIB)
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / "memory.max").write_text(str(4 * GIB))
    (pod / "memory.current").write_text(str(1 * GIB))
    assert HostMemory.read(proc, pod) == HostMemory(4 * GIB, 3 * GIB)


def server(name: str, ranks: int = 1, weights: int = GIB, per_token: int = 46080, seqs: int = 64) -> ServerMemory:
    return ServerMemory(name, ranks, weights, per_token, max_model_len=8192, max_num_seqs=seqs)


def test_auto_shares_what_weights_and_runtime_leave_over_every_rank_of_the_host():
    memory = HostMemory(24 * GIB, 16 * GIB)
    p, d = server("p0"), server("d0", ranks=2, weights=GIB // 2)
    sizes = auto_kv_cache_bytes(memory, [p, d], 0.5)
    left = 16 * GIB - (GIB + RANK_OVERHEAD_BYTES) - 2 * (GIB // 2 + RANK_OVERHEAD_BYTES)
    each = int(0.5 * left / 3) // MIB * MIB
    assert sizes == {"p0": each, "d0": each}
    assert 3 * each <= 0.5 * left


def test_auto_stops_at_what_every_sequence_at_full_length_could_hold():
    small = server("d0", per_token=256, seqs=4)
    assert auto_kv_cache_bytes(HostMemory(24 * GIB, 16 * GIB), [small], 0.5) == {"d0": 4 * 8192 * 256}


def test_auto_refuses_a_cache_smaller_than_one_full_length_sequence_with_the_figures():
    memory = HostMemory(4 * GIB, int(2.5 * GIB))
    with pytest.raises(KvMemoryError) as err:
        auto_kv_cache_bytes(memory, [server("p0"), server("d0")], 0.5)
    said = str(err.value)
    assert "kv_cache_bytes: auto leaves 0 MiB of KV cache to server 'p0'" in said
    assert "one sequence of 8192 tokens needs (360 MiB)" in said
    assert "2.5 GiB available" in said and "Set kv_cache_bytes" in said


def test_weight_bytes_are_the_loaded_models_parameters(tiny_llama_model):
    model, _ = load_model(tiny_llama_model, torch.float32, torch.device("cpu"))
    loaded = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    tied = {t.data_ptr() for t in model.state_dict().values()}
    assert len(tied) == len(model.state_dict())  # untied: each stored tensor loads once
    assert model_weight_bytes(Path(tiny_llama_model), 4) == loaded
    assert model_weight_bytes(Path(tiny_llama_model), 2) == loaded // 2


def test_a_cpu_rank_holds_its_part_of_the_weights_as_packed_and_a_gpu_rank_none_in_host_memory(
    tiny_llama_model, monkeypatch
):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "1")
    folder = Path(tiny_llama_model)
    weights = model_weight_bytes(folder, 4)
    cpu = server_memory("d0", folder, torch.float32, 2, False, None, 8, "cpu")
    assert cpu.weight_bytes_per_rank == weights // 2 and cpu.ranks == 2  # float32: once
    bf16 = server_memory("d0", folder, torch.bfloat16, 2, False, None, 8, "cpu")
    assert bf16.weight_bytes_per_rank == 2 * model_weight_bytes(folder, 2) // 2  # packed besides the plain weight
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "2")
    assert server_memory("d0", folder, torch.float32, 2, False, None, 8, "cpu").weight_bytes_per_rank == weights
    assert server_memory("d0", folder, torch.float32, 1, False, None, 8, "cuda:1").weight_bytes_per_rank == 0
    mock = server_memory("d0", folder, torch.float32, 1, False, None, 8, weights_loaded=False)
    assert mock.weight_bytes_per_rank == 0


@pytest.mark.parametrize("copies", ["1", "2"])
def test_a_float32_cpu_rank_is_counted_the_bytes_its_model_holds(tiny_model, monkeypatch, copies):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", copies)
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))  # tied: the lm_head an input-major copy
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    packed = [
        m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None and m.packed.is_mkldnn
    ]
    held.update({id(p): p.numel() * p.element_size() for p in packed})  # oneDNN's own copies, where kept
    counted = server_memory("d0", Path(tiny_model), torch.float32, 1, False, None, 8, "cpu").weight_bytes_per_rank
    norms = sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    assert counted == sum(held.values()) + (norms if copies == "2" else 0)  # two copies: the norms counted twice


def test_shipped_smollm2_configs_size_their_caches_from_the_host():
    for name in ("1p1d", "1p2d", "2p1d", "2p2d", "colocated"):
        cluster = parse_config(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()), f"{name}.yaml")
        assert cluster.engine.kv_cache_bytes == "auto", name


def test_a_server_started_alone_sizes_its_own_cache_and_an_override_wins(tiny_model):
    data = {
        "model": tiny_model,
        "engine": {"kv_cache_bytes": "auto", "max_num_seqs": 4},
        "prefill": [{"name": "p0", "port": 8100}],
        "decode": [{"name": "d0", "port": 8200, "kv_cache_bytes": 1 << 20}],
    }
    cluster = parse_config(data, "auto.yaml")
    full = 4 * 4096 * 2 * 2 * 2 * 16 * 4  # sequences x tokens x (2 layers, K and V, 2 heads of 16 floats)
    assert cluster.server_settings("p0", Path(tiny_model)).engine.kv_cache_bytes == full
    assert cluster.server_settings("p0", Path(tiny_model), 3 << 20).engine.kv_cache_bytes == 3 << 20
    assert cluster.server_settings("d0", Path(tiny_model)).engine.kv_cache_bytes == 1 << 20
    assert cluster.auto_kv_cache_bytes(["p0", "d0"], Path(tiny_model), HostMemory(8 * GIB, 4 * GIB)) == {"p0": full}


def test_the_fraction_is_bounded_and_auto_is_the_only_word(tiny_model):
    from deploy.config import ConfigError

    base = {"model": tiny_model, "prefill": [{"name": "p0", "port": 8100}], "decode": [{"name": "d0", "port": 8200}]}
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
        parse_config({**base, "engine": {"kv_cache_memory_fraction": 0.95}}, "f.yaml")
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        parse_config({**base, "engine": {"kv_cache_bytes": "lots"}}, "f.yaml")
