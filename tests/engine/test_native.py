"""engine.native's one-row bfloat16 kernel: built wherever the CPU can run it, equal to float32
arithmetic rounded once to bfloat16, and what ``Linear`` uses for one row."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.model import Linear
from tests.serving.cluster import REPO

CAN_RUN = native.unavailable() is None
needs_cpu = pytest.mark.skipif(not CAN_RUN, reason=f"native kernels cannot run here: {native.unavailable()}")


def test_the_kernels_build_wherever_the_cpu_can_run_them():
    if CAN_RUN:
        assert native.kernels() is not None, native.status()
        assert native.status() == "native CPU kernels: in use"
    else:
        assert native.kernels() is None and native.unavailable() in native.status()


def test_turned_off_it_says_so_and_the_command_reports_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert native.unavailable() == "PDSERVE_NATIVE=0"
    run = subprocess.run(
        [sys.executable, "-m", "engine.native", "--require"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PDSERVE_NATIVE": "0"},
    )
    assert run.returncode == 1 and "not used (PDSERVE_NATIVE=0)" in run.stdout
    assert (
        subprocess.run([sys.executable, "-m", "engine.native", "--help"], cwd=REPO, capture_output=True).returncode == 0
    )


def one_ulp_of(expected: torch.Tensor) -> torch.Tensor:
    """A bfloat16 value's spacing (8 bits of precision) at each of ``expected``'s magnitudes."""
    exponent = torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30)))
    return torch.exp2(exponent - 7)


@needs_cpu
@pytest.mark.parametrize(
    ("inputs", "outputs", "bias"), [(576, 960, False), (40, 7, True), (1536, 576, True), (32, 4, False)]
)
def test_gemv_is_float32_arithmetic_rounded_once(inputs, outputs, bias):
    torch.manual_seed(inputs + outputs)
    x = torch.randn(1, inputs).to(torch.bfloat16)
    w = torch.randn(outputs, inputs).to(torch.bfloat16)
    b = torch.randn(outputs).to(torch.bfloat16) if bias else None
    got = native.kernels().gemv_bf16(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == (1, outputs) and got.dtype == torch.bfloat16
    # float32 sums in another order than float64's: at most one bfloat16 step from the exact value's rounding
    assert ((got.double() - exact).abs() <= one_ulp_of(exact) + 1e-6).all()


@needs_cpu
def test_gemv_refuses_what_it_does_not_compute():
    gemv = native.kernels().gemv_bf16
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    for x in (torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(1, 32), torch.zeros(1, 16, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="gemv_bf16"):
            gemv(x, w)


@needs_cpu
@pytest.mark.parametrize("bias", [False, True])
def test_linear_sends_one_bfloat16_row_to_the_kernel_and_more_to_onednn(bias):
    torch.manual_seed(1)
    linear = Linear(96, 160, bias=bias).to(torch.bfloat16)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    assert linear.one_row is not None
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(x[:1]), native.kernels().gemv_bf16(x[:1], weight, b))
        assert torch.equal(linear(x), F.linear(x, weight, b))  # two rows and more: the packed copy
    float32 = Linear(96, 160).float()
    float32.pack_for_cpu()
    assert float32.one_row is None
