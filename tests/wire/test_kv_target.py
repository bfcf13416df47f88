"""wire/kv_target.py: where a prefill server writes a reservation's KV, checked once where the
reservation enters a process. A decode server of one rank writes no ``tp``; a group travels as
``transfer.messages``' builtins and comes back typed; anything else is refused naming the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.tensor_parallel import kv_heads_for_rank
from transfer.layout import KVLayout
from transfer.messages import DecodeGroup, DecodeRank, group_to_builtins
from wire.kv_target import KVTarget


def rank_layout(rank: int, size: int) -> KVLayout:
    return KVLayout.for_engine_cache(
        num_layers=2,
        num_blocks=8,
        block_size=16,
        num_kv_heads=4 // size,
        head_dim=8,
        dtype="float32",
        tp_rank=rank,
        tp_size=size,
        num_kv_heads_total=4,
        head_ids=kv_heads_for_rank(4, rank, size),
    )


GROUP = DecodeGroup(2, tuple(DecodeRank(r, ("d0", "d0-r1")[r], f"t{r}", rank_layout(r, 2)) for r in (0, 1)))


def test_a_decode_server_of_one_rank_writes_no_tp():
    target = KVTarget(peer="d0", epoch="9f2c")
    assert target.model_dump() == {"peer": "d0", "epoch": "9f2c"}
    assert json.loads(target.model_dump_json()) == {"peer": "d0", "epoch": "9f2c"}
    assert KVTarget.model_validate({"peer": "d0"}) == KVTarget(peer="d0", epoch="", tp=None)


def test_a_group_travels_as_builtins_and_comes_back_typed():
    target = KVTarget(peer="d0", epoch="e1", tp=GROUP)
    on_the_wire = json.loads(target.model_dump_json())
    assert on_the_wire == {"peer": "d0", "epoch": "e1", "tp": group_to_builtins(GROUP)}
    back = KVTarget.model_validate(on_the_wire)
    assert back == target
    assert isinstance(back.tp, DecodeGroup) and back.tp.ranks[1].layout == rank_layout(1, 2)


def test_a_target_is_frozen():
    target = KVTarget(peer="d0")
    with pytest.raises(ValidationError):
        target.peer = "d1"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"peer": "d0", "instance": "d0"}, "instance"),  # unknown fields are refused, not ignored
        ({"epoch": "e"}, "peer"),  # the agent name is required
        ({"peer": "-d0"}, "peer"),  # not an instance name
        ({"peer": "d0 x"}, "peer"),
        ({"peer": "d" * 65}, "peer"),
        ({"peer": "d0", "epoch": "e" * 65}, "epoch"),
        ({"peer": "d0", "tp": {"tp_size": 2, "ranks": []}}, "tp"),  # a group must list its ranks
        ({"peer": "d0", "tp": {"tp_size": 1}}, "tp"),
    ],
)
def test_a_bad_target_is_refused_naming_the_field(raw, field):
    with pytest.raises(ValidationError) as info:
        KVTarget.model_validate(raw)
    assert [e["loc"][0] for e in info.value.errors()] == [field]


def test_a_group_whose_ranks_repeat_a_transfer_id_is_refused():
    raw = group_to_builtins(GROUP)
    raw["ranks"][1]["transfer_id"] = "t0"
    with pytest.raises(ValidationError, match="ranks repeat a peer or a transfer id"):
        KVTarget.model_validate({"peer": "d0", "tp": raw})


def test_a_group_with_ranks_out_of_order_is_refused():
    raw = group_to_builtins(GROUP)
    raw["ranks"].reverse()
    with pytest.raises(ValidationError, match="entry 0 is rank 1"):
        KVTarget.model_validate({"peer": "d0", "tp": raw})
