"""A colocated server split over two ranks, through the router with the openai SDK: transformers'
greedy tokens and log-probabilities, n sequences, a JSON schema; every block free afterwards; a
rank killed with -9 takes its instance down, the launcher restarts the whole instance, and it
answers right again; a server killed with -9 leaves no rank behind."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from engine.request import StructuredSpec
from tests.engine.oracle import hf_greedy, hf_logits, hf_masked_greedy
from tests.support.cluster import start_cluster
from tests.support.oracle import chat_prompt_ids, tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TOL = 1e-4
TOP = 3
MESSAGES = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = start_cluster(
        tmp_path_factory,
        "colocated",
        tiny_model,
        {"max_model_len": 1024, "engine": {"tensor_parallel_size": 2, "block_size": 8}},
    )
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        60,
        "the two-rank server in the router's rotation",
    )
    yield c
    c.stop()


def ranks_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a server's tensor-parallel ranks)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields.get("PPid", "0")) == pid and fields.get("State", "").split()[0] != "Z":
            out.append(int(fields["Pid"]))
    return out


def answer_is_right(c, path: str) -> None:
    """Chat with log-probabilities, n = 3 and a JSON schema: each equal to transformers float32."""
    prompt = chat_prompt_ids(path, MESSAGES)
    ids = hf_greedy(path, prompt, 8, ignore_eos=True)
    tok = tokenizer(path)
    client = c.client()
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        n=3,
        extra_body={"ignore_eos": True},
    )
    rows = torch.log_softmax(hf_logits(path, prompt + ids), dim=-1)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for choice in r.choices:
        content = choice.logprobs.content
        assert [x.token for x in content] == [tok.decode([i]) for i in ids]
        for k, (x, token) in enumerate(zip(content, ids)):
            row = rows[len(prompt) - 1 + k]
            assert abs(x.logprob - row[token].item()) < TOL
            values, top_ids = row.topk(TOP)
            # by decoded text, most likely first on both sides (two byte pieces may both read "\ufffd")
            want = {tok.decode([i]): v for i, v in zip(top_ids.tolist(), values.tolist())}
            got = {t.token: t.logprob for t in x.top_logprobs}
            assert set(got) == set(want)
            assert all(abs(got[key] - want[key]) < TOL for key in want)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    want_json = tok.decode(hf_masked_greedy(path, prompt, spec, 60), skip_special_tokens=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, response_format=fmt
    )
    assert got.choices[0].message.content == want_json
    json.loads(want_json)
    c.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in c.blocks().values())


def test_two_ranks_answer_as_transformers_with_every_block_free_after(cluster, tiny_model):
    (server,) = cluster.servers
    assert len(ranks_of(server["pid"])) == 1  # rank 1; rank 0 is the server itself
    answer_is_right(cluster, tiny_model)


def test_a_rank_killed_restarts_the_whole_instance_which_answers_right_again(cluster, tiny_model):
    (server,) = cluster.servers
    (rank,) = ranks_of(server["pid"])
    os.kill(rank, signal.SIGKILL)

    def restarted() -> bool:
        path = cluster.run_dir / "restarts.json"
        done = json.loads(path.read_text())["restarts"] if path.exists() else []
        return any(r["name"] == server["name"] and r["back_after_s"] is not None for r in done)

    wait_until(restarted, 120, "the launcher restarted the instance whose rank died")
    restarts = json.loads((cluster.run_dir / "restarts.json").read_text())["restarts"]
    (restart,) = [r for r in restarts if r["name"] == server["name"]]
    assert restart["exit_status"] == 70  # the server ended itself: a rank of its engine died
    assert len(ranks_of(restart["pid"])) == 1  # the new instance has its own rank 1
    wait_until(
        lambda: all(w["healthy"] for w in cluster.http.get(f"{cluster.router_url}/health").json()["workers"]),
        60,
        "the restarted server back in the router's rotation",
    )
    answer_is_right(cluster, tiny_model)


def test_a_killed_server_leaves_no_rank_behind(cluster):
    restarts = json.loads((cluster.run_dir / "restarts.json").read_text())["restarts"]
    server = restarts[-1]["pid"]  # the instance the previous test's restart started
    (rank,) = ranks_of(server)
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not alive(rank), 30, "the rank of a killed server exits (its stdin pipe closed)")


def alive(pid: int) -> bool:
    """Running, or a zombie not reaped yet (exited: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
