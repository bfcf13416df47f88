"""Shared fixtures: small models the project builds itself, once per test session."""

from __future__ import annotations

import pytest

from engine.make_model import TinySpec, make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Qwen3 (per-head q/k norm, tied embeddings, GQA 4:2)."""
    return str(make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), TinySpec(arch="qwen3")))


@pytest.fixture(scope="session")
def tiny_llama_model(tmp_path_factory) -> str:
    """A tiny Llama (untied lm_head, GQA 4:2)."""
    return str(make_tiny(tmp_path_factory.mktemp("tiny-llama"), TinySpec(arch="llama", seed=1)))
