"""The tenant a request is for, on the router -> server control plane (wire/requests.py): a configured
tenant's name or nothing; anything else, on either server's route, is refused before it reaches an engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.request import SamplingParams
from wire.replies import Reservation
from wire.requests import GenerateRequest, PrefillRequest

RESERVATION = Reservation(
    instance="d0",
    request_id="r",
    transfer_id="t",
    block_ids=[0],
    block_size=16,
    num_tokens=2,
    lease_s=30,
    kv_target={"peer": "d0"},
)


def generate(**fields) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=[3, 4], sampling=SamplingParams(), **fields)


def prefill(**fields) -> PrefillRequest:
    return PrefillRequest(
        request_id="r", prompt_token_ids=[3, 4], sampling=SamplingParams(), reservation=RESERVATION, **fields
    )


@pytest.mark.parametrize("make", [generate, prefill])
@pytest.mark.parametrize("tenant", ["default", "team-a", "7", "a" * 63])
def test_a_tenant_s_name_crosses_as_it_is(make, tenant):
    assert make(tenant=tenant).tenant == tenant
    assert make().tenant is None  # the default tenant's


@pytest.mark.parametrize("make", [generate, prefill])
@pytest.mark.parametrize("tenant", ["", "Team-A", "team a", "-a", "a-", "a" * 64, "a:b", "lru:x", "a\nb", "dé", 7])
def test_anything_but_a_tenant_s_name_is_refused_naming_the_field(make, tenant):
    with pytest.raises(ValidationError) as caught:
        make(tenant=tenant)
    assert [e["loc"] for e in caught.value.errors()] == [("tenant",)]
