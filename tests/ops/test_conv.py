"""ops.conv (Triton, run by the CPU interpreter here) against the eager causal_short_conv of the KDA mixer."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.models.kda import causal_short_conv, short_conv_silu  # noqa: E402
from kimik3.ops import SHORT_CONV_MAX_TAPS  # noqa: E402
from kimik3.ops.conv import causal_conv_silu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


@pytest.mark.parametrize("B,T,C,W,parts", [(2, 70, 96, 4, 3), (1, 5, 40, 3, 1), (2, 300, 48, 4, 3)],
                         ids=["T70-C96-qkv", "T5-C40-W3", "T300-walkers"])
def test_matches_eager_conv(B, T, C, W, parts):
    """Forward and gradients. T300-walkers: 20 time tiles of the dz kernel (10 per batch row) over the
    interpreter's 8 programs, so programs walk several tiles, across a batch row, and sum their
    dweight shares over them."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(B, T, C + 7, generator=gen).to(DEVICE)
    x = wide[..., :C].detach().requires_grad_()  # a strided slice, as the fused projection gives
    weight = torch.randn(C, 1, W, generator=gen).to(DEVICE).requires_grad_()
    dy = torch.randn(B, T, C, generator=gen).to(DEVICE)
    got = causal_conv_silu(x, weight, parts)
    assert len(got) == parts and all(t.is_contiguous() and t.shape == (B, T, C // parts) for t in got)
    want = causal_short_conv(x, weight)
    torch.testing.assert_close(torch.cat(got, dim=-1), want, rtol=1e-5, atol=1e-5)
    g_got = torch.autograd.grad(got, (x, weight), dy.split(C // parts, dim=-1))
    g_want = torch.autograd.grad(want, (x, weight), dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_first_outputs_see_no_past():
    """Causality: changing x at time t leaves every output before t unchanged."""
    x = torch.randn(1, 8, 16, device=DEVICE)
    weight = torch.randn(16, 1, 4, device=DEVICE)
    before = causal_conv_silu(x, weight)[0]
    x[:, 5] += 10.0
    after = causal_conv_silu(x, weight)[0]
    assert torch.equal(before[:, :5], after[:, :5]) and not torch.equal(before[:, 5], after[:, 5])


def test_rejects_kernels_wider_than_the_backward_takes():
    with pytest.raises(ValueError, match="at most 4 taps"):
        causal_conv_silu(torch.zeros(1, 4, 16), torch.zeros(16, 1, 5))


def test_rejects_indivisible_parts():
    with pytest.raises(ValueError, match="parts=3"):
        causal_conv_silu(torch.zeros(1, 4, 16), torch.zeros(16, 1, 4), 3)


def test_an_unused_part_contributes_no_gradient():
    """Only q and k feed the loss: autograd hands the v part a zero gradient, and dx / dweight
    equal the eager conv's with v's outputs dropped."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 20, 48, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(48, 1, 4, generator=gen).to(DEVICE).requires_grad_()
    q, k, _ = causal_conv_silu(x, weight, 3)
    got = torch.autograd.grad((q * q).sum() + k.sum(), (x, weight))
    want_q, want_k, _ = causal_short_conv(x, weight).split(16, dim=-1)
    want = torch.autograd.grad((want_q * want_q).sum() + want_k.sum(), (x, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.all(got[1][32:] == 0)  # v's channels of dweight


@pytest.mark.parametrize("W", [4, 5])
def test_layer_conv_picks_the_kernel_on_cuda_only(W):
    """models/kda.short_conv_silu, which the KDA layer and benchmarks/memory_bound_ops.py both call:
    on CUDA the Triton kernel (each part its own contiguous tensor) for kernels of up to
    SHORT_CONV_MAX_TAPS taps, else the eager conv (views of one output; always off CUDA, even under
    the interpreter); the same values either way."""
    x = torch.randn(2, 9, 48, device=DEVICE)
    weight = torch.randn(48, 1, W, device=DEVICE)
    got = short_conv_silu(x, weight, parts=3)
    want = causal_short_conv(x, weight).split(16, dim=-1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(t.is_contiguous() for t in got) == (DEVICE == "cuda" and W <= SHORT_CONV_MAX_TAPS)
