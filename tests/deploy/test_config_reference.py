"""docs/config.md is what scripts/config_reference.py writes from the schema, and every key of the
schema says what it means, so neither a changed default nor a new key can land without its reference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import Field, SecretStr

from deploy.config import ClusterConfig, RouterConfig
from deploy.config_security import Strict

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "config_reference.py"


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_what_the_schema_gives(ref):
    assert (REPO / "docs" / "config.md").read_text() == ref.render(), (
        "docs/config.md is stale: run python3 scripts/config_reference.py and commit it"
    )


def test_every_key_has_a_meaning(ref):
    assert ref.missing_descriptions(ClusterConfig) == []


def test_a_key_without_a_docstring_is_named(ref):
    class Inner(Strict):
        documented: int = 1
        """Has one."""
        bare: int = 2

    class Item(Strict):
        bare: int = 3

    class Outer(Strict):
        inner: Inner = Inner()
        """A section."""
        items: list[Item] = Field(default_factory=list)
        """Items."""
        other: str = ""

    assert ref.missing_descriptions(Outer) == ["inner.bare", "items[].bare", "other"]


def test_every_key_of_the_schema_is_in_the_reference(ref):
    text = (REPO / "docs" / "config.md").read_text()
    for name in (
        "model",
        "router.grammar_limits.compile_memory_bytes",
        "security.internal_secret",
        "kubernetes.ucx_tls",
        "<role>[].kv_port",
        "<role>[].kv_layout",
    ):
        assert f"`{name}`" in text
    assert ref.count_keys() >= len(RouterConfig.model_fields)


def test_types_and_defaults_read_as_yaml(ref):
    rows = {r.key: r for s in ref.sections() for r in s.rows}
    assert rows["router.policy"].type == "one of `round_robin`, `least_loaded`, `cache_aware`"
    assert rows["router.api_keys"].type == "list of secret"
    assert rows["engine.num_blocks"].type == "int or null (>= 1)"
    assert rows["engine.chunked_prefill"].default == "`true`"
    assert rows["kubernetes.router_cpu"].default == "`'1'`"  # a string, as YAML must quote it
    assert rows["model"].default == "required"
    assert rows["<role>[].block_size"].default == "`engine.block_size`"
    assert rows["<role>[].kv_port"].default == "`null`"


def test_a_secret_default_is_never_shown(ref):
    class WithSecret(Strict):
        token: SecretStr = SecretStr("not-for-the-docs")
        """A secret."""

    info = WithSecret.model_fields["token"]
    assert ref.default_text(WithSecret, "token", info) == "(hidden)"


def test_check_names_a_stale_file(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--out", str(stale)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.strip() == f"{stale} is stale: run python3 scripts/config_reference.py and commit it"
    assert stale.read_text() == "# old\n"
