"""The load client against a real tiny cluster on 127.0.0.1 (processes stopped by pid)."""

import argparse
import json
import os

import pytest
import yaml

from bench import cli
from bench.compare.scenarios import EngineKnobs, cluster_config
from bench.load import timeline
from bench.load.cluster import _alive, cpu_list, free_port_pairs, launch
from bench.plan.plan import Candidate

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("cand", [Candidate(0, 1, 1), Candidate(1, 1, 1)], ids=["colocated", "1p1d"])
def test_bench_serve_measures_every_request_of_a_real_cluster(cand, tiny_model, tmp_path, capsys):
    knobs = EngineKnobs(kv_cache_bytes=8 * 1024 * 1024, max_num_seqs=8, max_num_batched_tokens=256)
    config = cluster_config(cand, tiny_model, free_port_pairs(1 + cand.instances), knobs)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster = launch(path, tmp_path / "run", cpu_list(None)[:1], timeout=180)
    try:
        secret_file = tmp_path / "run" / "internal_secret"  # pdserve launch made one: the config names none
        parser = argparse.ArgumentParser(prog="pdserve")
        cli.add_parser(parser.add_subparsers(dest="command", required=True))
        out = tmp_path / "result.json"
        common = [
            "bench",
            "serve",
            "--url",
            cluster.url,
            "--num-requests",
            "5",
            "--concurrency",
            "2",
            "--prompt-len",
            "uniform(8,40)",
            "--output-len",
            "6",
            "--json",
            str(out),
            "--no-progress",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "10000",
            "--timeline",
            str(tmp_path / "timeline.png"),
        ]
        # Without the secret the timeline cannot be read: said before the run, in one line.
        with pytest.raises(ValueError, match=r"^the router answered /debug/timeline with HTTP 401: .* --run-dir"):
            cli_args = parser.parse_args(common)
            cli_args.func(cli_args)
        assert not out.exists()
        args = parser.parse_args(common + ["--run-dir", str(tmp_path / "run")])  # the secret launch wrote there
        assert args.func(args) == 0
        ids = [r["request_id"] for r in json.loads(out.read_text())["requests"]]
        secret = secret_file.read_text().strip()
        stages = timeline.join(timeline.fetch(cluster.url, {"Authorization": f"Bearer {secret}"}), ids)
    finally:
        killed = cluster.stop()
    assert killed == []
    assert not any(_alive(p["pid"]) for p in cluster.processes())
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert (summary["completed"], summary["failed"], summary["good_requests"]) == (5, 0, 5)
    for r in data["requests"]:
        # Text prompts built with the model's tokenizer (found through /v1/models) are exact.
        assert r["server_prompt_tokens"] == r["prompt_len"] and 8 <= r["prompt_len"] <= 40
        assert r["output_tokens"] == 6 and r["ttft"] > 0 and r["tpot"] > 0
        assert len(r["token_times"]) >= 1
    printed = capsys.readouterr().out
    assert "different prompt length" not in printed
    # Every request's time, from the servers' own timings: the prefill stages exist exactly when a
    # prefill server took part, and the stages of one request follow each other.
    want = set(timeline.STAGES) - {"prefill on D"} if cand.num_prefill else {"router wait", "prefill on D", "decode"}
    assert len(stages) == 5 and {r.request_id for r in stages} == set(ids)
    for req in stages:
        assert {name for name, _, _ in req.stages} == want, req
        assert all(a <= b for _, a, b in req.stages)
    assert "timeline: dominant stage" in printed and (tmp_path / "timeline.png").stat().st_size > 10_000
    assert os.path.isfile(tmp_path / "run" / "cluster.json")
