"""scripts/gpu-check.sh, the run a leased GPU gets, works on CPU: every part runs small; the oracle rows say
that the Triton path (under Triton's interpreter here, also with the padded buffers CUDA graphs replay,
run eagerly) and the torch path give transformers' tokens; both clusters serve every request and move KV;
the table comes last."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_every_check_passes(tmp_path):
    run = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--device", "cpu", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["ok"] and report["info"]["device"] == "cpu"
    rows = {(r["part"], r["name"]): r["value"] for r in report["rows"]}
    for model in ("tiny-qwen3", "tiny-llama"):
        for backend in ("triton", "triton+graphs", "torch"):
            assert rows["oracle", f"{model} float32 {backend}: prompts equal to transformers"] == "3/3"
        assert 0 < rows["oracle", f"{model} bfloat16: largest prompt logprob difference from float32"] <= 0.1
    for layout in ("colocated", "1p1d"):
        assert rows["clusters", f"{layout}: requests failed"] == 0
        assert rows["clusters", f"{layout}: TPOT p50"] > 0
    assert rows["clusters", "1p1d: KV bytes moved"] > 0
    assert {part for part, _ in rows} == {"oracle", "bandwidth", "speed", "clusters", "tp"}
    assert rows["tp", "tensor parallel 2 (NCCL)"].startswith("skipped: needs two CUDA devices")
    assert run.stdout.rstrip().splitlines()[-1].startswith("gpu-check: all checks passed")


def test_an_unknown_part_to_skip_is_refused(capsys):
    from bench.gpu_check import main

    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--skip", "oracle,warp"])
    assert exit_.value.code == 2
    assert "--skip takes oracle, bandwidth, speed, clusters, tp, not warp" in capsys.readouterr().err
