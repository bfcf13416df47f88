"""Copy plans reproduce every token's K/V exactly and touch nothing else."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tensor_parallel import kv_heads_for_rank
from tests.transfer.oracle import copy_ranges, expected_after_copy
from transfer.copy import region_bytes
from transfer.layout import KVLayout
from transfer.plan import make_plan, ranges_inside, staging_layout

BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 32, 64)


@st.composite
def layout_pairs(draw):
    total = draw(st.sampled_from((1, 2, 4)))
    common = dict(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads_total=total,
        head_dim=draw(st.sampled_from((1, 2, 4))),
        dtype=draw(st.sampled_from(("float32", "bfloat16", "float8_e4m3fn"))),
    )
    end = draw(st.integers(0, 80))
    start = draw(st.integers(0, end))
    sides = []
    for _ in range(2):
        tp_size = draw(st.sampled_from([s for s in (1, 2, 4) if s % total == 0 or total % s == 0]))
        tp_rank = draw(st.integers(0, tp_size - 1))
        bs = draw(st.sampled_from(BLOCK_SIZES))
        need = -(-end // bs)
        num_blocks = need + draw(st.integers(1, 4))
        if draw(st.booleans()):
            first = draw(st.integers(0, num_blocks - need))
            ids = list(range(first, first + need))
        else:
            ids = draw(st.permutations(range(num_blocks)))[:need]
        layout = KVLayout(
            **common,
            head_ids=kv_heads_for_rank(total, tp_rank, tp_size),
            block_size=bs,
            num_blocks=num_blocks,
            order=draw(st.sampled_from(("NHD", "HND"))),
            kv_fused=draw(st.booleans()),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        sides.append((layout, ids))
    return sides[0], sides[1], start, end


def random_bytes(layout, seed):
    return np.random.default_rng(seed).integers(0, 256, layout.total_bytes, dtype=np.uint8)


def apply_plan(plan, layout_src, src_buf, dst_buf):
    src_t, dst_t = torch.from_numpy(src_buf), torch.from_numpy(dst_buf)
    for layer in range(layout_src.num_layers):
        copy_ranges(src_t, dst_t, *plan.layer(layer))


@settings(max_examples=150, deadline=None)
@given(layout_pairs(), st.integers(0, 2**32 - 1))
def test_plan_reproduces_kv_exactly_and_writes_nothing_else(pair, seed):
    (src, src_ids), (dst, dst_ids), start, end = pair
    src_buf, dst_buf = random_bytes(src, seed), random_bytes(dst, seed + 1)
    plan = make_plan(src, src_ids, start, end, dst, dst_ids)
    expected = expected_after_copy(src_buf, src, src_ids, start, end, dst_buf, dst, dst_ids)
    apply_plan(plan, src, src_buf, dst_buf)
    np.testing.assert_array_equal(dst_buf, expected)
    for layer in range(dst.num_layers):
        _, dst_off, lengths = plan.layer(layer)
        assert ranges_inside(dst, dst_ids, dst_off, lengths)


@settings(max_examples=40, deadline=None)
@given(layout_pairs(), st.sampled_from(("float32", "bfloat16", "float16")), st.integers(0, 1000))
def test_dtype_change_through_staging_reproduces_converted_values(pair, dst_dtype, seed):
    (src, src_ids), (dst, dst_ids), start, end = pair
    src, dst = src.replace(dtype="bfloat16"), dst.replace(dtype=dst_dtype)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(src.shape, generator=gen).to(torch.bfloat16)
    staging = cache.to(getattr(torch, dst_dtype))
    dst_cache = torch.zeros(dst.shape, dtype=getattr(torch, dst_dtype))
    plan = make_plan(staging_layout(src, dst_dtype), src_ids, start, end, dst, dst_ids)
    for layer in range(src.num_layers):
        copy_ranges(region_bytes(staging), region_bytes(dst_cache), *plan.layer(layer))
    expected = expected_after_copy(
        region_bytes(staging).numpy(),
        staging_layout(src, dst_dtype),
        src_ids,
        start,
        end,
        region_bytes(torch.zeros_like(dst_cache)).numpy(),
        dst,
        dst_ids,
    )
    np.testing.assert_array_equal(region_bytes(dst_cache).numpy(), expected)


def engine(bs, blocks, **kw):
    if kw.get("tp_size", 1) > 1:
        kw["head_ids"] = kv_heads_for_rank(kw["num_kv_heads_total"], kw["tp_rank"], kw["tp_size"])
    return KVLayout.for_engine_cache(
        num_layers=2, num_blocks=blocks, block_size=bs, num_kv_heads=2, head_dim=4, dtype="float32", **kw
    )


def test_identical_layouts_with_contiguous_blocks_merge_into_one_range_per_plane():
    layout = engine(16, 8)
    plan = make_plan(layout, [2, 3, 4], 0, 48, layout, [5, 6, 7])
    assert plan.num_ranges == 2
    assert plan.ranges(1) == [
        (
            layout.layer_bytes + 2 * layout.block_bytes,
            layout.layer_bytes + 5 * layout.block_bytes,
            3 * layout.block_bytes,
        ),
        (
            layout.layer_bytes + 10 * layout.block_bytes,
            layout.layer_bytes + 13 * layout.block_bytes,
            3 * layout.block_bytes,
        ),
    ]


def test_block_size_16_into_32_moves_half_blocks():
    src, dst = engine(16, 4), engine(32, 4)
    plan = make_plan(src, [0, 2, 1], 0, 40, dst, [3, 1])
    assert plan.layer_nbytes == 2 * 40 * src.num_heads * src.vec_bytes
    # sorted by source: src block 0 (tokens 0-15), 1 (32-39), 2 (16-31); K then V
    assert [length // (2 * 16) for length in plan.lengths.tolist()] == [16, 8, 16, 16, 8, 16]


def test_tp2_prefill_rank_writes_only_its_heads_into_tp1_decode():
    src = engine(16, 4, tp_rank=1, tp_size=2, num_kv_heads_total=4)
    dst = engine(16, 4).replace(head_ids=(0, 1, 2, 3), num_kv_heads_total=4)
    plan = make_plan(src, [0], 0, 16, dst, [1])
    assert plan.heads == (2, 3)
    assert plan.layer_nbytes == 2 * 16 * 2 * 16


def test_disjoint_heads_give_an_empty_plan():
    src = engine(16, 4, tp_rank=0, tp_size=2, num_kv_heads_total=4)
    dst = engine(16, 4, tp_rank=1, tp_size=2, num_kv_heads_total=4)
    assert make_plan(src, [0], 0, 16, dst, [0]).num_ranges == 0


@pytest.mark.parametrize(
    "ids,end,message", [([0], 17, "cannot hold 17 tokens"), ([0, 9], 20, "outside"), ([1, 1], 20, "repeat")]
)
def test_bad_block_tables_are_refused(ids, end, message):
    layout = engine(16, 4)
    with pytest.raises(ValueError, match=message):
        make_plan(layout, ids, 0, end, layout, [0, 1])


def test_dtype_mismatch_asks_for_staging():
    with pytest.raises(ValueError, match="staging_layout"):
        make_plan(engine(16, 4), [0], 0, 4, engine(16, 4).replace(dtype="bfloat16"), [0])


def test_ranges_inside_rejects_a_write_into_a_block_not_reserved():
    layout = engine(16, 8)
    assert ranges_inside(layout, [2, 3], [2 * layout.block_bytes], [2 * layout.block_bytes])
    assert not ranges_inside(layout, [2, 3], [2 * layout.block_bytes], [3 * layout.block_bytes])
    assert not ranges_inside(layout, [2, 3], [layout.total_bytes - 4], [8])
    assert not ranges_inside(layout, [7], [8 * layout.block_bytes - 4], [8])  # K plane into V plane
