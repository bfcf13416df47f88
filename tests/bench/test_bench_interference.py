"""bench.compare.interference on the tiny model: real engine processes, pinned, measured side by side."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_interference_measures_every_case_side_by_side(tiny_model, tmp_path):
    out = tmp_path / "interference.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.compare.interference",
        "--model",
        tiny_model,
        "--seconds",
        "0.5",
        "--prefill-tokens",
        "128",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if len(os.sched_getaffinity(0)) < 2:
        assert done.returncode == 2 and "needs two cores" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert list(result["cases"]) == [
        "decode alone",
        "decode + prefill",
        "decode + decode",
        "prefill alone",
        "prefill + decode",
    ]
    for case in result["cases"].values():
        assert case["steps"] >= 1 and 0 < case["median_ms"] and 0 < case["mean_ms"]
    cases = result["cases"]
    assert (
        result["slowdown"]["decode next to prefill"]
        == cases["decode + prefill"]["mean_ms"] / cases["decode alone"]["mean_ms"]
    )
    assert "| decode next to prefill |" in done.stdout and "[5/5] prefill + decode" in done.stderr


def test_interference_help_and_bad_arguments():
    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "bench.compare.interference", *a], capture_output=True, text=True, timeout=60
        )

    helped = run("--help")
    assert helped.returncode == 0 and "decode + prefill" in helped.stdout
    bad = run("--seconds", "0")
    assert bad.returncode == 2 and "must be positive" in bad.stderr
