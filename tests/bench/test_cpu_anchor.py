"""bench.cpu_anchor's parsing of llama.cpp's output and its ratio table (no build, no model)."""

import pytest

from bench.compare.llama_cpp import BenchResult, Timings, parse_llama_bench, parse_timings
from bench.cpu_anchor import LLAMA, Row, format_table, ordered

# What `llama-bench -o json -p 512 -n 0 -r 2` prints on stdout (fields abridged, order and shape kept).
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0a1b2c3",
    "build_number": 11434,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/root/.cache/pdserve/llama.cpp/gguf/smollm2-f32.gguf",
    "model_type": "llama ?B all F32",
    "model_size": 538066944,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-03T15:40:00Z",
    "avg_ns": 838000000,
    "stddev_ns": 2000000,
    "avg_ts": 611.2,
    "stddev_ts": 1.4,
    "samples_ns": [ 836000000, 840000000 ],
    "samples_ts": [ 612.4, 610.0 ]
  }
]
"""


def test_llama_bench_json_gives_threads_shape_and_tokens_per_second():
    assert parse_llama_bench(LLAMA_BENCH_JSON) == [BenchResult(512, 0, 2, 611.2, (612.4, 610.0))]


def test_llama_bench_output_with_log_lines_around_the_array_still_parses():
    text = "main: loading model\n" + LLAMA_BENCH_JSON.replace('"n_prompt": 512', '"n_prompt": 0').replace(
        '"n_gen": 0', '"n_gen": 128'
    )
    (result,) = parse_llama_bench(text + "llama_perf: done\n")
    assert (result.n_prompt, result.n_gen, result.tokens_per_s) == (0, 128, 611.2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("error: failed to load model", "no JSON array"),
        ('[ {"n_prompt": 512, ', "no JSON array"),
        ('[{"n_prompt": 512, "n_gen": 0, "n_threads": 2}]', "without 'avg_ts'"),
        ("[1, 2", "no JSON array"),
        ("[1, 2,]", "not JSON"),
    ],
)
def test_bad_llama_bench_output_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_llama_bench(text)


def test_llama_server_timings_are_read_from_the_completion_answer():
    body = {
        "content": "...",
        "timings": {
            "cache_n": 0,
            "prompt_n": 16,
            "prompt_ms": 30.5,
            "prompt_per_second": 524.6,
            "predicted_n": 128,
            "predicted_ms": 3950.2,
            "predicted_per_second": 32.4,
        },
    }
    assert parse_timings(body) == Timings(16, 524.6, 128, 32.4)
    with pytest.raises(ValueError, match="no timings"):
        parse_timings({"content": "x"})
    with pytest.raises(ValueError, match="predicted_per_second"):
        parse_timings({"timings": {"prompt_n": 1, "prompt_per_second": 1.0, "predicted_n": 1}})


def test_ratios_are_medians_and_above_one_when_pdserve_is_better():
    tput = Row("decode batch 1", "tok/s", True)
    for v in (20.0, 30.0, 25.0):
        tput.add("engine float32", v)
    for v in (50.0, 40.0, 60.0):
        tput.add(LLAMA, v)
    assert tput.ratios() == {"engine float32": 0.5}  # 25 / 50
    tpot = Row("TPOT p50", "ms", False)
    for side, values in (("pdserve colocated", [40.0, 44.0]), ("pdserve 1p1d", [30.0]), (LLAMA, [36.0, 30.0])):
        for v in values:
            tpot.add(side, v)
    assert tpot.ratios() == {"pdserve colocated": 33.0 / 42.0, "pdserve 1p1d": 33.0 / 30.0}
    data = tpot.to_json()
    assert data["sides"][LLAMA] == {"median": 33.0, "min": 30.0, "max": 36.0, "samples": [36.0, 30.0]}
    assert data["ratio_vs_llama_cpp"]["pdserve 1p1d"] == pytest.approx(1.1)


def test_a_row_without_llama_cpp_samples_has_no_ratio():
    row = Row("prefill", "tok/s", True)
    row.add("engine float32", 800.0)
    assert row.ratios() == {"engine float32": None}
    assert "| prefill | engine float32 | 800.0 tok/s (800.0-800.0) | - | - |" in format_table([row])


def test_table_has_one_line_per_pdserve_side_with_range_and_ratio():
    row = Row("8 streams: output tok/s", "tok/s", True)
    for side, values in (("pdserve colocated", [90.0, 110.0, 100.0]), ("pdserve 1p1d", [80.0]), (LLAMA, [50.0])):
        for v in values:
            row.add(side, v)
    lines = format_table([row]).splitlines()
    assert (
        lines[2]
        == "| 8 streams: output tok/s | pdserve colocated | 100.0 tok/s (90.0-110.0) | 50.0 tok/s (50.0-50.0) | 2.00x |"
    )
    assert (
        lines[3]
        == "| 8 streams: output tok/s | pdserve 1p1d | 80.0 tok/s (80.0-80.0) | 50.0 tok/s (50.0-50.0) | 1.60x |"
    )
    assert len(lines) == 4


def test_rounds_alternate_the_order_of_the_sides():
    assert [ordered(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
