"""Fixtures for the router's own tests (scripted workers, no servers): a byte-level
tokenizer folder and the model the router serves from it. They import what they need
themselves, so that the modules that use neither do not load transformers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.support.fakes import make_byte_tokenizer

    return make_byte_tokenizer(tmp_path_factory.mktemp("bytetok"), max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(model_dir):
    from router.api.model import ServedModel

    return ServedModel.load("tiny", str(model_dir))
