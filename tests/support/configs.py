"""Cluster configs for config tests: a minimal valid one, and the error a bad one raises."""

import pytest

from deploy.config import ConfigError, parse_config

BASE = {
    "model": "tiny",
    "prefill": [{"name": "p0", "port": 9100}],
    "decode": [{"name": "d0", "port": 9200, "block_size": 32}],
}


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.yaml")
    return str(info.value)
