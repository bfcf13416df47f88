"""`pdserve bench ...` and `pdserve plan` commands, end to end on fakes."""

import json

import pytest

from tests.bench.helpers import parser


@pytest.mark.parametrize("argv", [["bench", "serve"], ["bench", "compare"], ["plan"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    assert "usage: pdserve" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["engine", "transfer"])
def test_bench_engine_and_transfer_hand_every_argument_to_their_own_parsers(command):
    args = parser().parse_args(["bench", command, "--help"])
    assert args.argv == ["--help"]
    args = parser().parse_args(["bench", command, "--threads", "2", "--json", "x.json"])
    assert args.argv == ["--threads", "2", "--json", "x.json"]


@pytest.mark.parametrize("command", ["engine", "transfer"])
def test_bench_engine_and_transfer_help_is_their_own_under_pdserve_s_name(command, capsys):
    args = parser().parse_args(["bench", command, "--help"])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pdserve bench {command} ")


@pytest.mark.parametrize("bad", ["0", "1,x", ""])
def test_bench_engine_tp_sizes_are_checked_before_anything_runs(bad, capsys):
    from bench.micro import engine_bench

    with pytest.raises(SystemExit) as exit_:
        engine_bench.main(["--tp", bad], prog="pdserve bench engine")
    assert exit_.value.code == 2
    assert "--tp" in capsys.readouterr().err


def test_bench_engine_tp_table_puts_the_sizes_side_by_side():
    from bench.micro.tp_bench import table

    rows = [
        {
            "tp": tp,
            "decode_tok_s": 10.0 * tp,
            "decode_step_ms": 5.0,
            "decode_collective_share": share,
            "prefill_tok_s": 100.0,
            "prefill_collective_share": share / 2,
        }
        for tp, share in ((1, 0.0), (2, 0.25))
    ]
    lines = table(rows).splitlines()
    assert lines[2] == "| 1 | 10.0 | 5.0 | 0% | 100.0 | 0% |"
    assert lines[3] == "| 2 | 20.0 | 5.0 | 25% | 100.0 | 12% |"


def test_bench_serve_runs_against_an_endpoint_and_writes_json_and_plots(fake_openai_url, tmp_path, capsys):
    out = tmp_path / "run.json"
    args = parser().parse_args(
        [
            "bench",
            "serve",
            "--url",
            fake_openai_url,
            "--num-requests",
            "6",
            "--concurrency",
            "2",
            "--prompt-len",
            "uniform(8,40)",
            "--output-len",
            "5",
            "--prompt-format",
            "tokens",
            "--slo-ttft-ms",
            "5000",
            "--slo-tpot-ms",
            "1000",
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path / "plots"),
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Requests completed:" in printed and "Goodput" in printed
    assert "different prompt length" not in printed  # token prompts: the fake counts them
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 6 and data["summary"]["good_requests"] == 6
    assert data["config"]["model"] == "tiny" and data["config"]["api_key"] is None
    assert len(data["requests"]) == 6
    for r in data["requests"]:
        assert 8 <= r["prompt_len"] <= 40 and r["output_tokens"] == 5 and r["ttft"] > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "tpot_over_time.png").stat().st_size > 0


def test_bench_serve_reports_an_unreachable_server_as_failed_requests(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [1, 2, 3], "max_tokens": 2}\n')
    args = parser().parse_args(
        [
            "bench",
            "serve",
            "--url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--dataset",
            str(data),
            "--num-requests",
            "2",
            "--no-progress",
        ]
    )
    assert args.func(args) == 1
    assert "error: connection error: ConnectError" in capsys.readouterr().out


def test_bench_serve_without_a_server_to_ask_for_the_model_is_a_clear_error():
    args = parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "1"])
    with pytest.raises(ValueError, match="pass --model"):
        args.func(args)


def test_empty_dataset_is_a_clear_error(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    args = parser().parse_args(
        ["bench", "serve", "--model", "m", "--dataset", str(tmp_path / "e.jsonl"), "--num-requests", "1"]
    )
    with pytest.raises(ValueError, match="no requests"):
        args.func(args)
