"""Length distributions, mixes, arrivals and exact-length prompts."""

import json

import numpy as np
import pytest

from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.workload import LengthDist, RequestClass, Workload, load_jsonl, poisson_arrivals


def test_length_specs_parse_and_print_back():
    for spec in ("512", "uniform(128,1024)", "normal(512,64)", "normal(512,12.5)"):
        assert str(LengthDist.parse(spec)) == spec
    assert LengthDist.parse(" uniform( 2 , 4 ) ") == LengthDist("uniform", 2, 4)


@pytest.mark.parametrize("spec", ["0", "-3", "abc", "uniform(5,2)", "uniform(0,3)", "normal(0,1)", "gamma(1,2)"])
def test_bad_length_specs_are_refused_with_the_spec_quoted(spec):
    with pytest.raises(ValueError, match="bad length spec"):
        LengthDist.parse(spec)


def test_samples_stay_in_range():
    rng = np.random.default_rng(0)
    assert {LengthDist.parse("7").sample(rng) for _ in range(10)} == {7}
    uni = [LengthDist.parse("uniform(3,5)").sample(rng) for _ in range(300)]
    assert set(uni) == {3, 4, 5}
    norm = [LengthDist.parse("normal(2,10)").sample(rng) for _ in range(300)]
    assert min(norm) >= 1


def test_mix_classes_keep_prompt_and_output_lengths_together():
    wl = Workload.mix(["0.25:2048:16", "0.75:uniform(32,64):128"])
    specs = wl.specs(400, seed=1)
    longs = [s for s in specs if s.prompt_len == 2048]
    assert all(s.output_len == 16 for s in longs)
    assert all(32 <= s.prompt_len <= 64 and s.output_len == 128 for s in specs if s.prompt_len != 2048)
    assert 70 <= len(longs) <= 130
    assert wl.specs(400, seed=1) == specs
    assert str(wl) == "0.25:2048:16 + 0.75:uniform(32,64):128"


def test_bad_mix_class_is_refused():
    with pytest.raises(ValueError, match="WEIGHT:PROMPT:OUTPUT"):
        RequestClass.parse("2048:16")
    with pytest.raises(ValueError, match="weight"):
        RequestClass.parse("x:1:2")


def test_poisson_arrivals_start_at_zero_and_have_the_rate_asked():
    times = poisson_arrivals(4.0, 4001, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 4000 == pytest.approx(0.25, rel=0.05)
    assert poisson_arrivals(float("inf"), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0, 3)


def test_jsonl_dataset_reads_text_and_token_prompts(tmp_path, tiny_tokenizer_dir):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "alpha beta", "max_tokens": 4})
        + "\n\n"
        + json.dumps({"prompt": [5, 6, 7], "output_len": 2})
        + "\n"
    )
    specs = load_jsonl(path, load_tokenizer(tiny_tokenizer_dir))
    assert [(s.prompt_len, s.output_len) for s in specs] == [(2, 4), (3, 2)]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1"):
        load_jsonl(path)


@pytest.mark.parametrize("fixture", ["tiny_tokenizer_dir", "bos_tokenizer_dir"])
def test_text_prompts_encode_to_exactly_the_length_asked(fixture, request):
    tok = load_tokenizer(request.getfixturevalue(fixture))
    builder = PromptBuilder(tok)
    rng = np.random.default_rng(0)
    for n in [2, 3, 17, 128, 1000, 2048, *rng.integers(2, 600, size=20)]:
        prompt = builder.build(int(n), rng)
        assert prompt.num_tokens == n
        assert len(tok.encode(prompt.text)) == n
        assert tok.encode(prompt.text) == prompt.token_ids


def test_bos_counts_toward_the_prompt_length(bos_tokenizer_dir):
    builder = PromptBuilder(load_tokenizer(bos_tokenizer_dir))
    assert builder.num_special == 1
    with pytest.raises(ValueError, match="too short"):
        builder.build(1, np.random.default_rng(0))


def test_missing_tokenizer_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
