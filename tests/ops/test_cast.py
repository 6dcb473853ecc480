"""ops.cast: the bf16 -> fp32 gradient cast (Triton; the CPU interpreter here) is bit-identical to
Tensor.float(), and bf16_weight trains as weight.to(bf16) does."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.cast import bf16_weight  # noqa: E402
from kimik3.ops.cast_kernels import downcast_fp32, upcast_bf16  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


@pytest.mark.parametrize("shape", [(1,), (4095,), (4096,), (3, 4097), (2, 33, 65)])
def test_upcast_is_bit_identical_to_float(shape):
    """Sizes below, at and just past the kernel's 4096-element block, infs, NaNs, -0.0 and subnormals."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 1e3).to(torch.bfloat16)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40], dtype=torch.bfloat16)
    flat = x.view(-1)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    x = x.to(DEVICE)
    got, want = upcast_bf16(x), x.float()
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits, so NaN == NaN


@pytest.mark.parametrize("shape", [(1,), (4095,), (4096,), (3, 4097), (2, 33, 65)])
def test_downcast_rounds_bit_identically_to_torch(shape):
    """Random values at every exponent scale, ties (both parities), values that round up to inf,
    infs, signed zeros and subnormals: the same bits as `Tensor.to(bf16)`; NaNs stay NaN."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-140, 128, shape, generator=gen).float())
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FF000], dtype=torch.int64).to(torch.int32)
    specials = torch.cat([ties.view(torch.float32), torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1e-40,
                                                                   -3e-39])])
    flat = x.view(-1)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    flat[-1] = float("nan")
    x = x.to(DEVICE)
    got, want = downcast_fp32(x), x.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("cast, dtype", [(upcast_bf16, torch.bfloat16), (downcast_fp32, torch.float32)])
def test_casts_refuse_what_they_cannot_read(cast, dtype):
    with pytest.raises(ValueError, match=f"contiguous {dtype}"):
        cast(torch.zeros(4, 4, dtype=dtype, device=DEVICE).t())
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match=f"contiguous {dtype}"):
        cast(torch.zeros(4, dtype=other, device=DEVICE))


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_weight_gradient_matches_autograd_cast(transposed):
    """A matmul through bf16_weight gives the fp32 weight the gradient a plain .to(bf16) gives,
    bit for bit, also when the bf16 copy is used transposed (as the grouped GEMMs do)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 48, 32, generator=gen).to(DEVICE).requires_grad_()
    x = torch.randn(3, 16, 48 if transposed else 32, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(3, 16, 32 if transposed else 48, generator=gen).to(DEVICE, torch.bfloat16)
    grads = []
    for cast in (lambda t: t.to(torch.bfloat16), bf16_weight):
        wb = cast(w)
        y = torch.bmm(x, wb) if transposed else torch.bmm(x, wb.transpose(-2, -1))
        assert wb.dtype == torch.bfloat16
        (g,) = torch.autograd.grad(y, w, dy)
        grads.append(g)
    assert grads[1].dtype == torch.float32 and torch.equal(grads[0], grads[1])
