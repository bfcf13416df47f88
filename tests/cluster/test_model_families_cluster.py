"""The model families beyond dense Llama/Qwen, served 1P1D through the router with the openai SDK (prefill
blocks of 4, decode blocks of 16 in HND), greedy answers and log-probabilities equal to transformers, every
block free after:

- tiny-moe (Qwen3-MoE): the decode server on two ranks with expert parallelism (each holds 4 of the 8
  experts), so the KV crosses from one rank to two and each decode step sums the two halves of the experts;
  and the other way, from a prefill server on two such ranks to a decode server on one, over NIXL;
- tiny-swa (Gemma 3's shape): sliding-window layers of 8 tokens and global ones, on prompts many windows
  long, the prefill server sending a window layer's last 7 tokens only (all the decode server reads), the
  bytes moved exactly those; and the same from a prefill server on two ranks, each sending its heads'
  part of every layer's own range;
- tiny-mla (DeepSeek-V3's shape: latent attention, a dense first layer, then shared and routed experts):
  the latent cache crosses from one prefill rank to two decode ranks, each receiving the whole latent,
  and over NIXL from two prefill ranks (each holding the whole latent, one sending it) to one."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import cache_heads, layer_tokens_sent
from engine.loader import head_dim_of, load_config
from engine.make_model import TINY_MLA, TINY_MOE, TINY_SWA, make_tiny
from engine.model import layer_windows
from engine.tensor_parallel import Shard
from tests.engine.oracle import hf_greedy, hf_logits
from tests.support.cluster import start_cluster
from tests.support.oracle import chat_prompt_ids, expected_completion, tokenizer
from tests.transfer.conftest import nixl_available
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
TP2, EP2 = {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "expert_parallel_size": 2}
FAMILIES = {  # name: (model, the decode server's engine keys, the prefill server's, the transfer backend)
    "tiny-moe": (TINY_MOE, EP2, {}, "zmq"),
    "tiny-moe-p2-nixl": (TINY_MOE, {}, EP2, "nixl"),
    "tiny-swa": (TINY_SWA, {}, {}, "zmq"),
    "tiny-swa-p2": (TINY_SWA, {}, TP2, "zmq"),
    "tiny-mla": (TINY_MLA, TP2, {}, "zmq"),
    "tiny-mla-p2-nixl": (TINY_MLA, {}, TP2, "nixl"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    spec, decode, prefill, backend = FAMILIES[request.param]
    if backend == "nixl" and not nixl_available():
        pytest.skip("nixl not installed")
    model = str(make_tiny(tmp_path_factory.mktemp(request.param), spec))
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        model,
        {
            "decode": [{"name": "d0", "block_size": 16, "kv_layout": "HND", **decode}],
            "transfer": {"backend": backend},
        },
        {"p0": prefill},
    )
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        60,
        "the decode server in the router's rotation",
    )
    yield c, model
    c.stop()


def answers_and_logprobs_equal_transformers(cluster, model: str, prompts: tuple[str, ...]) -> None:
    """Greedy completions of ``prompts`` are transformers' text, and a chat answer's tokens and their
    log-probabilities transformers' (within 1e-4), through the router with the openai SDK."""
    client = cluster.client()
    for prompt in prompts:
        want, _ = expected_completion(model, prompt, 12)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
    prompt = chat_prompt_ids(model, MESSAGES)
    ids = hf_greedy(model, prompt, 8, ignore_eos=True)
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    tok = tokenizer(model)
    rows = torch.log_softmax(hf_logits(model, prompt + ids), dim=-1)
    content = r.choices[0].logprobs.content
    assert [x.token for x in content] == [tok.decode([i]) for i in ids]
    for k, (x, token) in enumerate(zip(content, ids)):
        assert abs(x.logprob - rows[len(prompt) - 1 + k][token].item()) < 1e-4


def test_answers_and_logprobs_equal_transformers(family):
    cluster, model = family
    prompts = ("Hello, world! How are you today?", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026.")
    answers_and_logprobs_equal_transformers(cluster, model, prompts)
    assert cluster.metric("p0", 'pdserve_requests_total{outcome="ok"}') >= 3  # every prompt prefilled on p0
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())


def test_the_kv_moved_is_each_full_layer_s_prompt_and_each_window_layer_s_last_tokens(family):
    cluster, model = family
    cfg = load_config(model)
    heads, width, _ = cache_heads(cfg, Shard(0, 1, False), head_dim_of(cfg))  # the prefill server's one rank
    layer_token_bytes = 2 * heads * width * 4  # K and V of a token in one layer, float32
    before = cluster.metric("p0", "pdserve_transfer_bytes_total")
    prompt = "Zebras graze while the kettle sings: " + " ".join(str(i * 7) for i in range(30))  # cached nowhere
    r = cluster.client().completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    n = r.usage.prompt_tokens
    moved = cluster.metric("p0", "pdserve_transfer_bytes_total") - before
    windows = layer_windows(cfg)
    assert moved == layer_tokens_sent(windows, n) * layer_token_bytes
    full = n * cfg.num_hidden_layers * layer_token_bytes
    if any(w is not None for w in windows):
        assert moved < full / 2  # tiny-swa: 3 of its 4 layers send 7 of the prompt's n tokens
    else:
        assert moved == full
