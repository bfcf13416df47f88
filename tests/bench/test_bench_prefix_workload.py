"""--shared-prefix and --multi-turn workloads (bench/load/prefix_workload.py): exact token lengths,
prefixes shared exactly where the workload says."""

from __future__ import annotations

import json

import pytest

from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.workload import LengthDist
from tests.bench.helpers import parser


def shared_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("fixture", ["tiny_tokenizer_dir", "bos_tokenizer_dir"])
def test_shared_prefix_prompts_have_exact_lengths_and_share_exactly_the_prefix(fixture, request):
    builder = PromptBuilder(load_tokenizer(request.getfixturevalue(fixture)))
    w = PrefixWorkload("shared_prefix", LengthDist.parse("30"), LengthDist.parse("8"), shared_tokens=200, groups=2)
    prompts = [builder.from_segments(w.request(i, seed=3)[0], 3) for i in range(4)]
    special = builder.num_special
    assert [p.num_tokens for p in prompts] == [special + 230] * 4
    assert [w.request(i)[1] for i in range(4)] == [8] * 4
    # the same group shares the prefix and no more (the questions differ from their first word on)
    assert shared_len(prompts[0].token_ids, prompts[2].token_ids) == special + 200
    assert shared_len(prompts[0].token_ids, prompts[1].token_ids) < special + 200


def test_multi_turn_prompts_grow_by_the_last_answer_and_a_new_question(tiny_tokenizer_dir):
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    w = PrefixWorkload("multi_turn", LengthDist.parse("20"), LengthDist.parse("10"), turns=3, conversations=2)
    prompts = [builder.from_segments(w.request(i)[0], 0) for i in range(6)]
    # requests 0, 2, 4: turns 0, 1, 2 of chat 0; 1, 3, 5 of chat 1
    assert [p.num_tokens for p in prompts] == [20, 20, 50, 50, 80, 80]
    assert shared_len(prompts[2].token_ids, prompts[0].token_ids) == 20  # turn 0 is all of turn 1's start
    assert shared_len(prompts[4].token_ids, prompts[2].token_ids) == 50
    assert shared_len(prompts[1].token_ids, prompts[0].token_ids) < 20  # another chat
    assert w.request(6)[0][0].key != w.request(0)[0][0].key  # after 3 rounds: new chats
    # every turn after the first reuses all of the previous prompt: (20 + 50 + 20 + 50) of 300
    assert w.best_hit_rate(6, 0) == pytest.approx(140 / 300)


def test_a_shared_prefix_best_hit_rate_counts_each_group_once():
    w = PrefixWorkload("shared_prefix", LengthDist.parse("10"), LengthDist.parse("4"), shared_tokens=90, groups=2)
    assert w.best_hit_rate(10, 1) == pytest.approx(8 * 91 / (10 * 101))


@pytest.mark.parametrize(
    "flags, lengths",
    [
        (["--shared-prefix", "64", "--prompt-len", "16"], [80] * 4),
        (["--multi-turn", "2", "--conversations", "2", "--prompt-len", "16"], [16, 16, 37, 37]),
    ],
)
def test_bench_serve_sends_the_prefix_workloads(fake_openai_url, tmp_path, flags, lengths):
    out = tmp_path / "run.json"
    args = parser().parse_args(
        [
            "bench",
            "serve",
            "--url",
            fake_openai_url,
            "--num-requests",
            "4",
            "--concurrency",
            "1",
            "--output-len",
            "5",
            "--prompt-format",
            "tokens",
            "--json",
            str(out),
            "--no-progress",
            *flags,
        ]
    )
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert sorted(r["prompt_len"] for r in data["requests"]) == lengths
