"""KVLayout: engine shapes, sizes, TP head split, compatibility check."""

import pytest
import torch

from transfer.layout import IncompatiblePeer, KVLayout, check_compatible


def engine_layout(**kw):
    args = dict(num_layers=2, num_blocks=10, block_size=16, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16)
    args.update(kw)
    return KVLayout.for_engine_cache(**args)


def test_engine_layout_matches_engine_tensor_shape_and_bytes():
    layout = engine_layout()
    cache = torch.zeros(2, 2, 10, 16, 4, 8, dtype=torch.bfloat16)
    assert layout.shape == tuple(cache.shape)
    assert layout.total_bytes == cache.numel() * cache.element_size()
    assert (layout.dtype, layout.order, layout.kv_fused) == ("bfloat16", "NHD", False)
    assert layout.head_ids == (0, 1, 2, 3)


def test_vector_offset_of_v_in_last_block_points_at_the_tensor_element():
    layout = engine_layout(dtype="float32")
    cache = torch.zeros(layout.shape)
    cache[1, 1, 9, 15, 3] = 7.0
    flat = cache.reshape(-1)
    off = int(layout.vector_offsets(1, 9, 15, 3)) + layout.layer_bytes
    assert flat[off // 4] == 7.0


def test_hnd_and_fused_layouts_have_their_shapes():
    base = engine_layout()
    assert base.replace(order="HND").shape == (2, 2, 10, 4, 16, 8)
    assert base.replace(kv_fused=True).shape == (2, 10, 2, 16, 4, 8)


def test_a_rank_of_several_must_say_which_heads_it_holds():
    with pytest.raises(ValueError, match="say which KV heads it holds"):
        engine_layout(tp_rank=1, tp_size=2, num_kv_heads=2, num_kv_heads_total=4)
    assert engine_layout(tp_rank=1, tp_size=2, num_kv_heads=2, head_ids=(2, 3)).head_ids == (2, 3)


def test_bad_dtype_is_refused_with_the_value():
    with pytest.raises(ValueError, match="int8"):
        engine_layout(dtype="int8")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_layers", 3, "num_layers: prefill has 2, decode has 3"),
        ("head_dim", 16, "head_dim: prefill has 8, decode has 16"),
    ],
)
def test_incompatible_peer_error_names_both_values(field, value, message):
    mine = engine_layout()
    theirs = engine_layout(**{field: value})
    with pytest.raises(IncompatiblePeer, match=message):
        check_compatible("m", mine, "m", theirs, "prefill", "decode")


def test_different_total_heads_and_models_are_refused():
    with pytest.raises(IncompatiblePeer, match="num_kv_heads_total: prefill has 4, decode has 8"):
        check_compatible("m", engine_layout(), "m", engine_layout(num_kv_heads=8), "prefill", "decode")
    with pytest.raises(IncompatiblePeer, match="model: prefill has 'a', decode has 'b'"):
        check_compatible("a", engine_layout(), "b", engine_layout(), "prefill", "decode")


def test_convertible_differences_are_accepted():
    mine = engine_layout()
    theirs = engine_layout(
        block_size=32, dtype="float32", tp_rank=1, tp_size=2, num_kv_heads=2, num_kv_heads_total=4, head_ids=(2, 3)
    ).replace(order="HND")
    check_compatible("m", mine, "m", theirs, "prefill", "decode")
