"""Draining through a real 1P2D cluster with `drain: wait` (tests/faults/test_migration.py
covers the default, `migrate`): a drained worker finishes its requests in flight and gets
no new ones, whether drained through the router's admin endpoint or by SIGTERM; stopping
the launcher drains the router first.

The tests share one cluster and run in file order: the SIGTERM test stops d0
for good, the last one stops the whole cluster."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.engine.oracle import hf_greedy
from tests.guard.conftest import start
from tests.support.cluster import _alive
from tests.support.oracle import PROMPTS, tokenizer

pytestmark = pytest.mark.integration

LONG = 500  # tokens: long enough to be in flight while the test acts, on a slow shared machine
# Each decode server's engine waits this long after every step (server_common.faults): a long answer then
# takes seconds however fast the engine decodes the tiny model, and is still in flight while the test acts.
STEP_DELAY_S = 0.005
SHORT = 8
LONG_PROMPTS = (PROMPTS[0], PROMPTS[3])  # two, so that the oracle computes two long answers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    for prompt in LONG_PROMPTS:  # the oracle's long answers, before the cluster competes for the cores
        expected(tiny_model, prompt, LONG, ignore_eos=True)
    # round robin: four requests in a row are two on each decode server, whatever their reported load
    c = start(
        tmp_path_factory,
        "1p2d",
        tiny_model,
        {"max_model_len": 1024, "drain": "wait", "router": {"policy": "round_robin"}, "fault_injection": True},
    )
    for name in ("d0", "d1"):
        c.http.post(f"{c.server(name)['url']}/admin/faults", json={"step_delay_s": STEP_DELAY_S}).raise_for_status()
    yield c
    c.stop()


@functools.lru_cache(maxsize=16)
def expected(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> str:
    tok = tokenizer(model)
    ids = hf_greedy(model, tok(prompt)["input_ids"], max_tokens, ignore_eos=ignore_eos)
    return tok.decode(ids, skip_special_tokens=True)


class LongStream(threading.Thread):
    """A streamed completion of LONG tokens read on its own thread; ``started`` is set at its first chunk."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.started = threading.Event()
        self.text, self.finish, self.error = "", None, None

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": self.prompt,
            "max_tokens": LONG,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    self.started.set()
                    self.text += event["choices"][0]["text"]
                    self.finish = event["choices"][0]["finish_reason"] or self.finish
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()


def start_streams(url: str, n: int) -> list[LongStream]:
    streams = [LongStream(url, LONG_PROMPTS[i % len(LONG_PROMPTS)]) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(30)
    return streams


def assert_finished_correctly(streams: list[LongStream], model: str) -> None:
    for s in streams:
        s.join(60)
        assert s.error is None and s.finish == "length", (s.error, s.finish)
        assert s.text == expected(model, s.prompt, LONG, ignore_eos=True)


def short_answers(cluster, n: int, model: str) -> None:
    client = cluster.client()
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=SHORT, temperature=0)
        assert r.choices[0].text == expected(model, prompt, SHORT, ignore_eos=False)


def wait_idle(cluster, names: list[str], timeout: float = 5.0) -> None:
    """Every named server holds no reserved or running block (``timeout`` to get there)."""
    deadline = time.monotonic() + timeout
    while True:
        blocks = {n: cluster.http.get(f"{cluster.server(n)['url']}/health").json()["kv_blocks"] for n in names}
        if all(b["reserved"] == 0 and b["running"] == 0 for b in blocks.values()):
            return
        assert time.monotonic() < deadline, blocks
        time.sleep(0.02)


def reserved(cluster, name: str) -> float:
    """Requests the decode server took: reserved for a prefill server, or prefilled itself (a
    prompt whose all but last token it holds in its prefix cache)."""
    return sum(
        cluster.metric(name, f'pdserve_request_paths_total{{path="{path}"}}') for path in ("remote_kv", "local_prefill")
    )


def test_a_worker_drained_through_the_router_finishes_its_requests_and_gets_no_new_ones(cluster, tiny_model):
    streams = start_streams(cluster.router_url, 4)
    before = reserved(cluster, "d0"), reserved(cluster, "d1")
    drained = cluster.http.post(f"{cluster.router_url}/admin/workers/d0/drain").json()
    assert drained["draining"] and not drained["in_rotation"] and drained["inflight"] == 2
    short_answers(cluster, 4, tiny_model)
    assert (reserved(cluster, "d0"), reserved(cluster, "d1")) == (before[0], before[1] + 4)
    done = cluster.http.post(f"{cluster.router_url}/admin/workers/d0/drain", params={"wait_s": 60}).json()
    assert done["inflight"] == 0
    assert_finished_correctly(streams, tiny_model)
    resumed = cluster.http.post(f"{cluster.router_url}/admin/workers/d0/resume").json()
    assert resumed["in_rotation"]
    cluster.wait_idle(5.0)


def test_sigterm_drains_a_decode_server_whose_requests_finish_while_new_ones_go_elsewhere(cluster, tiny_model):
    d0 = cluster.server("d0")
    streams = start_streams(cluster.router_url, 4)
    assert cluster.http.get(f"{d0['url']}/health").json()["num_requests"] == 2
    before = reserved(cluster, "d1")
    os.kill(d0["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 5
    while cluster.http.get(f"{d0['url']}/health").json()["status"] != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = cluster.http.post(
        f"{d0['url']}/generate", json={"request_id": "late", "prompt_token_ids": [1], "sampling": {"max_tokens": 1}}
    )
    assert refused.status_code == 503 and refused.json()["code"] == "draining"
    short_answers(cluster, 4, tiny_model)
    assert reserved(cluster, "d1") == before + 4  # all four went to d1 (d0 may have exited by now)
    assert_finished_correctly(streams, tiny_model)
    deadline = time.monotonic() + 15
    while _alive(d0["pid"]):
        assert time.monotonic() < deadline, "d0 did not exit after draining"
        time.sleep(0.1)
    assert cluster.launcher.poll() is None  # the cluster keeps serving without d0
    short_answers(cluster, 2, tiny_model)
    assert "d0 drained and stopped" in (cluster.run_dir / "launcher.log").read_text()
    wait_idle(cluster, ["p0", "d1"])


def test_stopping_the_launcher_lets_requests_in_flight_finish(cluster, tiny_model):
    streams = start_streams(cluster.router_url, 2)
    cluster.launcher.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while True:  # the router drains: new requests get a clear 503 while the old ones finish
        resp = cluster.http.post(
            f"{cluster.router_url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}
        )
        if resp.status_code == 503:
            break
        # on failure, what the launcher did with its SIGTERM (it stops the router first)
        assert resp.status_code == 200 and time.monotonic() < deadline, (
            resp.status_code,
            (cluster.run_dir / "launcher.log").read_text()[-2000:],
        )
        time.sleep(0.02)
    assert resp.json()["error"]["code"] == "draining" and resp.headers["retry-after"]
    assert_finished_correctly(streams, tiny_model)
    assert cluster.launcher.wait(30) == 0
    assert not any(_alive(p["pid"]) for p in cluster.manifest["processes"])
