"""A prompt longer than the prefill server's whole KV cache (but within the context) on a real 1P1D:
the router sends it straight to the decode server, which computes it, exact; a short request sent
at the same time is not held up behind it (it used to wait for the prefill lease to expire)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.cluster import Cluster, make_config
from tests.support.oracle import expected_completion, tokenizer

pytestmark = pytest.mark.integration
P_BLOCKS = 64  # of 4 tokens: p0 holds 256 tokens; d0 (blocks of 16, 16 MiB) holds far more
LONG = " ".join(f"word{i}" for i in range(200))  # several hundred tokens
SHORT = "a short question"


@pytest.fixture(scope="module")
def small_prefill(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("capacity")
    path = make_config(folder, "tiny-1p1d", tiny_model, {"lease_s": 10}, instances={"p0": {"num_blocks": P_BLOCKS}})
    cluster = Cluster(path, folder)
    yield cluster
    cluster.stop()


def test_a_prompt_the_prefill_cache_cannot_hold_is_prefilled_on_the_decode_server_and_holds_nobody_up(
    small_prefill, tiny_model
):
    cluster = small_prefill
    num_tokens = len(tokenizer(tiny_model)(LONG)["input_ids"])
    assert num_tokens + 1 > P_BLOCKS * 4
    prefilled_before = cluster.metric("p0", 'pdserve_requests_total{outcome="ok"}')
    client = cluster.client(timeout=60)
    short_times: list[float] = []

    def short() -> None:
        start = time.monotonic()
        out = client.completions.create(model="tiny", prompt=SHORT, max_tokens=2, temperature=0)
        short_times.append(time.monotonic() - start)
        assert (out.choices[0].text, out.usage.completion_tokens) == expected_completion(tiny_model, SHORT, 2)

    start = time.monotonic()
    beside = threading.Thread(target=short)
    beside.start()
    out = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0)
    long_s = time.monotonic() - start
    beside.join(60)
    print(
        f"{num_tokens}-token prompt over p0's {P_BLOCKS * 4}-token cache: answered in {long_s:.2f} s; "
        f"a short request beside it in {short_times[0]:.2f} s"
    )
    assert (out.choices[0].text, out.usage.completion_tokens) == expected_completion(tiny_model, LONG, 4)
    assert short_times and short_times[0] < 5.0  # the 10 s lease never came into it
    assert long_s < 5.0
    assert cluster.metric("d0", 'pdserve_request_paths_total{path="local_prefill"}') >= 1
    assert cluster.metric("p0", 'pdserve_requests_total{outcome="ok"}') - prefilled_before <= 1  # the short one
    cluster.wait_idle(10.0)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())
