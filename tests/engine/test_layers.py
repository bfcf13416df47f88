"""The model's CPU fast paths compute what the plain formulas compute: RMSNorm and RoPE bit for bit,
packed projections to float32 rounding (bfloat16 bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.loader import load_model
from engine.model import Linear, RMSNorm, rotate
from engine.runner import RoPE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rmsnorm_equals_hugging_face_arithmetic(dtype, tokens):
    torch.manual_seed(tokens)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(tokens, 64) * 5).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_rotate_half_form(dtype):
    class Config:
        rope_theta = 10000.0

    rope = RoPE(Config(), 64, 512, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 77, 511])
    cos = rope.cos[0, positions].unsqueeze(1)  # the one table of a model without per-layer RoPE
    sin_signed = rope.sin_signed[0, positions].unsqueeze(1)
    half = 32
    sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), dim=-1)  # the table before signing
    assert torch.equal(sin[..., :half], sin[..., half:])  # sin repeats over the two halves, as HF's does
    x = torch.randn(len(positions), 6, 64).to(dtype)
    assert torch.equal(rotate(x, cos, sin_signed), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_plain_linear(dtype, bias):
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=bias).to(dtype)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert linear.packed is None  # oneDNN cannot pack bfloat16 on this CPU: torch's matmul serves it
    else:
        assert linear.packed is not None
    assert torch.equal(linear.weight, weight)  # same [out, in] values whatever the layout
    if dtype == torch.float32:
        assert linear.weight.t().is_contiguous()  # input-major, for the one-row matmul
    for rows in (1, 2, 8, 65):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            got, expected = linear(x), F.linear(x, weight, b)
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_float32_prefill_rows_go_to_torchs_matmul_on_avx2_alone(bias):
    """On a CPU whose best vectors are AVX2, MKL_MIN_ROWS rows and more of a float32 projection are torch's
    matmul over the input-major weight (oneDNN's packed copy is slower there); elsewhere oneDNN's; never
    the lm_head's wide matrix."""
    torch.manual_seed(0)
    linear, wide = Linear(96, 160, bias=bias), Linear(8, Linear.MKL_MAX_OUT + 1, bias=False)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    wide.pack_for_cpu()
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2" and linear.packed is not None
    assert linear.mkl_min_rows == (Linear.MKL_MIN_ROWS if avx2 else 0)
    assert wide.mkl_min_rows == 0
    for rows in (Linear.MKL_MIN_ROWS - 1, Linear.MKL_MIN_ROWS, 1027):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            got = linear(x)
            if avx2 and rows >= Linear.MKL_MIN_ROWS:
                assert torch.equal(got, F.linear(x, linear.weight, linear.bias))
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def held_bytes(model) -> int:
    """The bytes of every distinct storage the model's parameters and its Linear layers' packed tensors hold
    (a oneDNN-packed copy, opaque, holds its own)."""
    tensors = [*model.state_dict().values()]
    tensors += [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    storages = {
        id(t) if t.is_mkldnn else t.untyped_storage().data_ptr(): (
            t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
        )
        for t in tensors
    }
    return sum(storages.values())


def test_a_float32_projection_on_cpu_can_hold_its_weight_once(monkeypatch):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "1")
    linear = Linear(96, 160).float()
    linear.pack_for_cpu()
    assert linear.packed is not None and not linear.packed.is_mkldnn  # oneDNN reads the weight in place
    assert linear.packed.untyped_storage().data_ptr() == linear.weight.untyped_storage().data_ptr()
    assert linear.packed.shape == (160, 96) and linear.weight.t().is_contiguous()


def test_a_float32_projection_keeps_a_packed_copy_where_asked(monkeypatch):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "2")
    linear = Linear(96, 160).float()
    weight = linear.weight.detach().clone()
    linear.pack_for_cpu()
    assert linear.packed is not None and linear.packed.is_mkldnn
    x = torch.randn(65, 96)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_float32_model_holds_its_weights_once_and_a_tied_lm_head_twice(tiny_model, monkeypatch):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "1")
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))
    # tied: the embedding stored once, and the lm_head's input-major copy beside it (both in the state dict)
    loaded = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held_bytes(model) == loaded
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "2")
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))
    projections = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Linear))
    # every projection's packed copy besides, but the lm_head's where a few rows' logits read the embedding
    # (Linear.read_rows) and oneDNN reads its input-major copy in place for more
    head = model.lm_head.weight.nbytes if model.lm_head.rows_kernel is not None else 0
    assert held_bytes(model) == loaded + projections - head


def test_a_float32_weight_copies_setting_other_than_one_or_two_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", "3")
    with pytest.raises(ValueError, match="PDSERVE_F32_WEIGHT_COPIES must be 1 or 2, not '3'"):
        Linear(96, 160).float().pack_for_cpu()


def test_packing_a_tied_model_keeps_the_embedding_rows(tiny_model):
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))  # tied embeddings; packed on load
    embedding = model.embed_tokens.weight
    assert embedding.is_contiguous()
    assert model.lm_head.weight is not embedding
    assert torch.equal(model.lm_head.weight, embedding)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
