"""engine/row_buckets.py: the row counts oneDNN's packed projections see are a few fixed sizes, the
rows kept are the unpadded projection's bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.model import Linear
from engine.row_buckets import bucket_rows, packed_linear, row_pieces

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
# oneDNN packs bfloat16 only on a CPU that converts it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere the engine
# keeps no bfloat16 packed copy (engine/model.py Linear.pack_for_cpu), so there is no such path to check
packed_bfloat16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN cannot pack bfloat16 on this CPU"
    ),
)


def test_rows_round_up_to_multiples_of_8_then_four_sizes_an_octave():
    assert [bucket_rows(n) for n in (1, 8, 9, 16, 17, 57, 64)] == [8, 8, 16, 16, 24, 64, 64]
    assert [bucket_rows(n) for n in (65, 80, 81, 127, 128)] == [80, 80, 96, 128, 128]
    assert [bucket_rows(n) for n in (129, 160, 161, 255, 256, 257)] == [160, 160, 192, 256, 256, 320]
    assert [bucket_rows(n) for n in (2047, 2048, 2049, 8191)] == [2048, 2048, 2560, 8192]


def test_up_to_2048_rows_there_are_28_sizes_none_a_quarter_above_the_rows_past_64():
    sizes = {bucket_rows(n) for n in range(1, 2049)}
    assert len(sizes) == 28 and max(sizes) == 2048
    assert len({bucket_rows(n) for n in range(1, 8193)}) == 36
    assert all(n <= bucket_rows(n) <= max(64, n * 1.25) for n in range(1, 8193))


def test_rows_just_past_a_bucket_are_cut_into_buckets():
    assert row_pieces(1027) == [1024, 3]  # a 1024-token prompt beside three decodes: 1280 rows padded whole
    assert row_pieces(2050) == [2048, 2]
    assert row_pieces(1100) == [1024, 76] and row_pieces(1089) == [1024, 65]
    # where the rest would be a matmul of many rows for a little padding, the rows are padded whole
    assert row_pieces(300) == [300] and row_pieces(1279) == [1279] and row_pieces(1024) == [1024]
    assert row_pieces(40) == [40] and row_pieces(65) == [65]
    for rows in range(1, 8193):
        pieces = row_pieces(rows)
        assert sum(pieces) == rows and len(pieces) <= 4
        assert sum(bucket_rows(p) for p in pieces) <= bucket_rows(rows), rows
    # the pieces' kernels are the buckets': no size beyond the 28 up to 2048 rows
    assert {bucket_rows(p) for rows in range(1, 2049) for p in row_pieces(rows)} <= {
        bucket_rows(n) for n in range(1, 2049)
    }


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, packed_bfloat16])
def test_padded_projection_keeps_each_rows_numbers_bit_for_bit(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    for rows in (2, 9, 17, 64, 65, 100, 129, 300, 1027, 1100):
        x = torch.randn(rows, 64).to(dtype)
        plain = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        padded = packed_linear(x, packed, bias)
        assert padded.shape == (rows, 96)
        assert torch.equal(padded, plain), rows


@needs_onednn
def test_a_packed_linear_gives_the_unpadded_projection_for_a_prompt_of_any_length():
    torch.manual_seed(0)
    linear = Linear(64, 96)
    plain = Linear(64, 96)
    plain.load_state_dict(linear.state_dict())
    linear.pack_for_cpu()
    with torch.no_grad():
        for rows in (9, 33, 77, 200):
            x = torch.randn(rows, 64)
            assert torch.allclose(linear(x), plain(x), atol=1e-5), rows
