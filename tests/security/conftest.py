"""A 1P1D cluster under `pdserve launch` (restart on, a generated internal
secret, tight router connection limits, the fault hook to break a transfer
thread) that the attack tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from deploy.config import load_config
from tests.support.cluster import Cluster, make_config
from transfer.layout import KVLayout

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 6
# Above the router's worker_keepalive_s (2 s), so the servers never close an idle connection it may reuse.
SERVER_HEADER_TIMEOUT_S = 4.0
SERVER_MAX_CONNECTIONS, SERVER_RESERVED_CONNECTIONS = 64, 16


class Target:
    """The cluster, plus what an attacker on the host can learn about it."""

    def __init__(self, cluster: Cluster, config: Path) -> None:
        self.cluster = cluster
        cfg = load_config(config)
        self.kv_endpoint = f"tcp://127.0.0.1:{cfg.instance('d0').transfer_port}"
        self.model = str(cfg.model_path())
        hf = AutoConfig.from_pretrained(self.model)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # A prefill-side layout the decode server accepts (block size and count are converted).
        self.layout = KVLayout.for_engine_cache(
            num_layers=hf.num_hidden_layers,
            num_blocks=8,
            block_size=4,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            dtype="float32",
        )
        self.secret = (cluster.run_dir / "internal_secret").read_text().strip()


@pytest.fixture(scope="package")
def target(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("attacked")
    config = make_config(
        folder,
        "tiny-1p1d",
        tiny_model,
        {
            "drain_timeout_s": 5,
            "restart": {"backoff_s": 0.2},
            "fault_injection": True,
            "router": {"header_timeout_s": HEADER_TIMEOUT_S, "max_connections_per_client": MAX_CONNECTIONS},
            "security": {
                "server_header_timeout_s": SERVER_HEADER_TIMEOUT_S,
                "server_max_connections": SERVER_MAX_CONNECTIONS,
                "server_reserved_connections": SERVER_RESERVED_CONNECTIONS,
            },
        },
    )
    cluster = Cluster(config, folder)
    yield Target(cluster, config)
    cluster.stop()
