"""Tenants through the router app (scripted workers): limits answered as OpenAI does, classes checked."""

from router.settings import TenantSettings
from tests.support.fakes import FakeWorkerClient
from tests.support.router_client import make_client, reply_ids

TENANTS = (
    # A token a second: what refills between a request and its answer stays under one token, so the
    # remaining count the headers show is exact.
    TenantSettings("team-a", ("key-a",), requests_per_minute=2, tokens_per_minute=60),
    TenantSettings("batchers", ("key-b",), priority="batch"),
    TenantSettings("small", ("key-s",), tokens_per_minute=10),
)


def post(c, key, headers=None, **body):
    return c.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 4, **body},
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )


def test_a_tenant_past_its_request_limit_gets_429_and_every_answer_carries_its_limits(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok"))
    with make_client(model, fake, api_keys=("key-a", "key-b"), tenants=TENANTS) as c:
        first = post(c, "key-a")
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-limit-tokens"] == "60"
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        assert first.headers["x-ratelimit-remaining-tokens"] == str(60 - prompt_tokens - 4)
        streamed = post(c, "key-a", stream=True)
        assert streamed.status_code == 200 and streamed.headers["x-ratelimit-remaining-requests"] == "0"
        refused = post(c, "key-a")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        other = post(c, "key-b")  # another tenant's limits are its own
        assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers
        metrics = c.get("/metrics").text
    assert len(fake.opened) == 3  # the refused one never reached a server
    assert 'pdserve_router_tenant_requests_total{status="429",tenant="team-a"} 1.0' in metrics
    assert 'pdserve_router_tenant_requests_total{status="200",tenant="batchers"} 1.0' in metrics


def test_a_request_larger_than_a_minute_of_tokens_is_refused_before_any_server(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok"))
    with make_client(model, fake, api_keys=("key-s",), tenants=TENANTS) as c:
        r = post(c, "key-s", max_tokens=20)
    assert r.status_code == 429 and "more than tenant 'small' may use in a minute (10)" in r.json()["error"]["message"]
    assert fake.opened == []


def test_priority_classes_named_in_the_header_are_checked(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok"))
    with make_client(model, fake, api_keys=("key-a", "key-b"), tenants=TENANTS) as c:
        assert post(c, "key-a", {"X-Priority-Class": "batch"}).status_code == 200
        higher = post(c, "key-b", {"X-Priority-Class": "interactive"})
        unknown = post(c, "key-b", {"X-Priority-Class": "gold"})
    assert higher.status_code == 403 and higher.json()["error"]["code"] == "priority_not_allowed"
    assert unknown.status_code == 400 and "'gold'" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["param"] == "x-priority-class"
    assert len(fake.opened) == 1


def test_metrics_show_each_configured_tenants_slots_and_held_back_requests_never_a_key(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "one two three four five six seven eight"), delay=0.2)
    with make_client(model, fake, api_keys=("key-a", "key-b"), tenants=TENANTS) as c:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 16, "stream": True}
        with c.stream("POST", "/v1/completions", json=body, headers={"Authorization": "Bearer key-b"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)  # answering: its decode slot is held until its stream ends
            during = c.get("/metrics").text.splitlines()
            rest = list(lines)
        after = c.get("/metrics").text.splitlines()
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert 'pdserve_router_tenant_slots{tenant="batchers"} 1.0' in during
    assert 'pdserve_router_tenant_slots{tenant="team-a"} 0.0' in during
    for tenant in ("team-a", "batchers", "small", "default"):
        assert f'pdserve_router_tenant_slots{{tenant="{tenant}"}} 0.0' in after
        assert f'pdserve_router_tenant_held_back_total{{tenant="{tenant}"}} 0.0' in after
    assert not [line for line in during + after if "pdserve_router_tenant_" in line and "key-" in line]
