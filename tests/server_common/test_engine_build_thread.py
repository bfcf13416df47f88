"""A server's engine, built with ``build_engine`` and stepped on its engine thread, keeps one OpenMP
team: its workers spin between kernels instead of sleeping and waking for each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.make_model import TinySpec, make_tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory) -> str:
    """SmolLM2-135M's layer sizes, fewer layers: matmuls big enough for OpenMP to split them."""
    spec = TinySpec(arch="llama", layers=4, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536)
    return str(make_tiny(tmp_path_factory.mktemp("smollm2-shaped"), spec))


def switches_per_step(where: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "tests.server_common.build_thread_child", where, model],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["switches_per_step"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for a team of two OpenMP threads")
def test_engine_built_off_the_serving_thread_keeps_openmp_spinning(smollm2_shaped):
    on_main = switches_per_step("main", smollm2_shaped)
    built_apart = switches_per_step("build_engine", smollm2_shaped)
    # Built on the main thread, the engine thread's team is a second one: its workers sleep and
    # wake for each of the step's parallel kernels (dozens per step).
    assert on_main >= 20, on_main
    assert built_apart <= on_main / 5, (built_apart, on_main)
