"""Sampling parameters at the edges of what the API accepts never produce NaN
(one such request used to kill the engine thread, and with it the server), and
greedy picks what argmax picks at the edges too."""

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import sample


def rows(*params: SamplingParams) -> list[Request]:
    return [Request(str(i), [1], p) for i, p in enumerate(params)]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 9e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 10
    params = [SamplingParams(temperature=temperature, seed=s) for s in (None, 1, 2)]
    assert sample(logits, rows(*params), torch.Generator()) == [([t], None) for t in logits.argmax(-1).tolist()]


def test_greedy_takes_the_first_of_equal_logits_and_a_nan_where_there_is_one():
    # a vocabulary as wide as SmolLM2's, so the reduction runs in many vector chunks and on both threads
    logits = torch.zeros(5, 49152)
    for r in range(4):
        logits[r, [40000 - 3000 * r, 100 + 5000 * r, 49151]] = 7.0
    logits[4, [777, 30000]] = float("nan")
    expected = [100, 5100, 10100, 15100, 777]
    assert logits.argmax(-1).tolist() == expected
    assert sample(logits, rows(*[SamplingParams(temperature=0)] * 5), torch.Generator()) == [
        ([t], None) for t in expected
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_over_a_small_temperature_still_sample(dtype):
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 20).to(dtype)
    params = SamplingParams(temperature=2e-5, top_p=5e-324, top_k=7, seed=3)
    ((tokens, _),) = sample(logits, rows(params), torch.Generator())
    assert tokens == [int(logits.float().argmax())]


def test_minus_infinity_log_probabilities_are_reported_as_the_floor():
    from engine.request import LOGPROB_FLOOR, Logprob
    from engine.sampler import top_logprobs

    logprobs = torch.tensor([[0.0, float("-inf")]])
    assert top_logprobs(logprobs, torch.tensor([1]), [2]) == [Logprob(LOGPROB_FLOOR, ((0, 0.0), (1, LOGPROB_FLOOR)))]
    assert top_logprobs(logprobs, torch.tensor([1]), [0]) == [Logprob(LOGPROB_FLOOR)]


def test_a_row_with_every_token_masked_samples_like_greedy_instead_of_raising():
    # min_tokens holds back the only tokens left: every logit is -inf
    logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    masked = dict(min_tokens=3, stop_token_ids=(0, 1, 2, 3))
    params = [SamplingParams(temperature=0.7, seed=1, **masked), SamplingParams(temperature=0, **masked)]
    draws = sample(logits.clone(), rows(*params), torch.Generator())
    assert draws == [([0], None), ([0], None)]


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_a_repetition_penalty_below_float32s_range_never_draws_a_masked_token(temperature):
    # 5e-324 is 0 in float32: -inf * 0 is NaN and 3 / 0 is +inf; neither may beat the mask
    logits = torch.tensor([[float("-inf"), 3.0, float("-inf"), -1.0]])
    params = SamplingParams(temperature=temperature, seed=4, repetition_penalty=5e-324)
    request = Request("0", [0, 1, 2, 3], params)
    ((tokens, _),) = sample(logits, [request], torch.Generator())
    assert tokens == [1]
