"""Fixtures for the serving tests. Each integration module defines a module-scoped
``cluster`` (real processes); tests use ``served``, which checks afterwards that
every server is back to zero reserved and running KV blocks."""

from __future__ import annotations

import pytest

from tests.serving.cluster import Cluster, make_config


def start_cluster(tmp_path_factory, template: str, model: str, changes: dict | None = None) -> Cluster:
    folder = tmp_path_factory.mktemp(template)
    return Cluster(make_config(folder, template, model, changes), folder)


THRESHOLD = 12  # 1P1D: prompts shorter than this are prefilled on the decode server
MAX_MODEL_LEN = 1024


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


# For the router's own tests (test_router_app.py, test_router_logprobs.py): a byte-level tokenizer
# folder and the model the router serves from it. They import what they need themselves, so that
# the modules that use neither do not load transformers.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.serving.fakes import make_byte_tokenizer

    return make_byte_tokenizer(tmp_path_factory.mktemp("bytetok"), max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(model_dir):
    from router.api.model import ServedModel

    return ServedModel.load("tiny", str(model_dir))
