"""ops.norm (Triton, run by the CPU interpreter here) against the eager modules it replaces on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.models.blocks import RMSNorm  # noqa: E402
from kimik3.models.kda import GatedRMSNorm  # noqa: E402
from kimik3.ops.norm import gated_rms_norm, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7
"""bf16 results may differ by one bf16 ulp: the CPU interpreter truncates fp32 -> bf16 where the GPU
(and torch) round to nearest even."""
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 3).to(DEVICE, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE)
    dy = torch.randn(*shape, generator=gen).to(DEVICE)
    return x, w, dy


def _grads(out, dy, *tensors):
    return torch.autograd.grad(out, tensors, dy.to(out.dtype))


def _close(got, want, dtype):
    """fp32: to rounding. bf16: within a few ulps of the largest value (sums of ulp-sized differences
    can cancel, so a near-zero element is held to the tensor's scale, not its own)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_ULP, atol=4 * BF16_ULP * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 5, 48), (2, 130)], ids=["odd-D48", "D130-not-pow2"])
def test_rms_norm_matches_module(shape, dtype):
    x, w, dy = _inputs(shape, dtype)
    ref = RMSNorm(shape[-1], 1e-5).to(DEVICE)
    ref.weight.data.copy_(w)
    w = ref.weight.detach().clone().requires_grad_()
    out, expect = rms_norm(x, w, 1e-5), ref(x)
    assert out.dtype == expect.dtype and out.shape == expect.shape
    _close(out, expect, dtype)
    for got, want in zip(_grads(out, dy, x, w), _grads(expect, dy, x, ref.weight)):
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_rms_norm_matches_module(dtype):
    x, w, dy = _inputs((4, 3, 2, 64), dtype, seed=1)
    gate = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype).requires_grad_()
    ref = GatedRMSNorm(64, 1e-6).to(DEVICE)
    ref.weight.data.copy_(w)
    w = ref.weight.detach().clone().requires_grad_()
    out, expect = gated_rms_norm(x, gate, w, 1e-6), ref(x, gate)
    assert out.dtype == expect.dtype == dtype
    _close(out, expect, dtype)
    for got, want in zip(_grads(out, dy, x, gate, w), _grads(expect, dy, x, gate, ref.weight)):
        _close(got, want, dtype)


def test_gated_rms_norm_rejects_mismatched_gate():
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.zeros(2, 8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
