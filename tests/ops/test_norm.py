"""ops.norm (Triton, run by the CPU interpreter here) against the eager modules (and adds) it replaces on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.models.blocks import RMSNorm  # noqa: E402
from kimik3.models.kda import GatedRMSNorm  # noqa: E402
from kimik3.ops.norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7
"""One bf16 ulp: the kernels and torch round fp32 -> bf16 alike (to nearest even, the interpreter too:
ops/triton_interpret.py), but their fp32 sums run in other orders, which can move a value across a
rounding boundary."""
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
@pytest.mark.parametrize("shape", [(3, 5, 48), (2, 130), (40, 16, 48)], ids=["odd-D48", "D130-not-pow2", "many-tiles"])
def test_rms_norm_matches_module(shape, dtype):
    """many-tiles: 640 rows in 32-row tiles over the interpreter's 16 programs, so each program walks
    several tiles and sums its weight-gradient products over them."""
    x, w, dy = _inputs(shape, dtype)
    ref = RMSNorm(shape[-1], 1e-5).to(DEVICE)
    ref.weight.data.copy_(w)
    w = ref.weight.detach().clone().requires_grad_()
    out, expect = rms_norm(x, w, 1e-5), ref(x)
    assert out.dtype == expect.dtype and out.shape == expect.shape
    _close(out, expect, dtype)
    for got, want in zip(_grads(out, dy, x, w), _grads(expect, dy, x, ref.weight)):
        _close(got, want, dtype)


@pytest.mark.parametrize("used", ["hy", "y", "h"], ids=["h-and-y-used", "only-y-used", "only-h-used"])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.bfloat16], ids=["r-fp32", "r-bf16"])
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 130)], ids=["odd-D37", "D130-not-pow2"])
def test_add_rms_norm_matches_add_then_module(shape, r_dtype, used):
    """fp32 residual stream x + branch output r, then the norm: h bit-exact, y and the gradients of
    x, r, w as eager `h = x + r; RMSNorm(h)`, whichever of h (dh) and y (dy) is used downstream."""
    x, w, dy = _inputs(shape, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    r = torch.randn(shape, generator=gen).to(DEVICE, r_dtype).requires_grad_()
    dh = torch.randn(shape, generator=gen).to(DEVICE)
    ref = RMSNorm(shape[-1], 1e-5).to(DEVICE)
    ref.weight.data.copy_(w)
    w = ref.weight.detach().clone().requires_grad_()
    h, y = add_rms_norm(x, r, w, 1e-5)
    h_ref = x + r
    y_ref = ref(h_ref)
    assert h.dtype == h_ref.dtype == y.dtype == y_ref.dtype == torch.float32
    assert torch.equal(h, h_ref)
    _close(y, y_ref, torch.float32)
    pick = {"hy": (0, 1), "y": (1,), "h": (0,)}[used]

    def grads(outs, wrt):  # zeros for an unused input (w, when only h is used)
        return torch.autograd.grad([outs[i] for i in pick], wrt, [(dh, dy)[i] for i in pick], materialize_grads=True)

    got, want = grads((h, y), (x, r, w)), grads((h_ref, y_ref), (x, r, ref.weight))
    assert [g.dtype for g in got] == [torch.float32, r_dtype, torch.float32]
    for g, e, dtype in zip(got, want, (torch.float32, r_dtype, torch.float32)):
        _close(g, e, dtype)


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_kernels_round_their_output_to_out_dtype(residual):
    """out_dtype=bf16 (what RMSNorm.feeds_matmul asks for under autocast): y is the fp32 output
    rounded once, and a bf16 dy gives the gradients the fp32 output's cast would pass back."""
    x, w, dy = _inputs((3, 70), torch.float32, seed=5)
    w.requires_grad_()
    r = torch.randn(3, 70, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    dy = dy.to(torch.bfloat16)

    def run(out_dtype):
        if residual:
            return add_rms_norm(x, r, w, 1e-5, out_dtype)[1]
        return rms_norm(x, w, 1e-5, out_dtype)

    got, wide = run(torch.bfloat16), run(None)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32
    _close(got, wide.to(torch.bfloat16), torch.bfloat16)
    for g, e in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(wide.to(torch.bfloat16), (x, w), dy)):
        _close(g, e, torch.float32)


@pytest.mark.parametrize("feeds_matmul, x_dtype, want", [
    (True, torch.float32, torch.bfloat16), (False, torch.float32, torch.float32),
    (True, torch.float64, torch.float64)], ids=["feeds-matmul", "plain", "fp64-untouched"])
def test_norm_feeding_a_matmul_returns_autocast_dtype(feeds_matmul, x_dtype, want):
    """Under autocast a norm marked feeds_matmul returns the autocast dtype, holding exactly what
    autocast's cast of its usual output holds (forward and add_forward); outside autocast, unmarked,
    or for fp64 (which autocast leaves alone) its usual dtype. The eager path: bit-exact."""
    gen = torch.Generator().manual_seed(7)
    x, r = (torch.randn(4, 48, generator=gen, dtype=x_dtype) for _ in range(2))
    norm = RMSNorm(48, 1e-5, feeds_matmul=feeds_matmul).to(x_dtype)
    plain = RMSNorm(48, 1e-5).to(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, (h, y_add) = norm(x), norm.add_forward(x, r)
        y_plain, y_add_plain = plain(x), plain.add_forward(x, r)[1]
    assert y.dtype == y_add.dtype == want and h.dtype == x_dtype
    assert torch.equal(y, y_plain.to(want)) and torch.equal(y_add, y_add_plain.to(want))
    assert norm(x).dtype == x_dtype  # autocast off


def test_add_rms_norm_rejects_mismatched_residual():
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="add_rms_norm: r"):
        add_rms_norm(x, torch.zeros(16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 3, 2, 64), (40, 16, 128)], ids=["small", "many-tiles"])
def test_gated_rms_norm_matches_module(shape, dtype):
    """many-tiles: 640 rows of D = 128 in 16-row tiles over the interpreter's 16 programs (the KDA
    output's shape class), each program summing its weight-gradient products over several tiles."""
    x, w, dy = _inputs(shape, dtype, seed=1)
    gate = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype).requires_grad_()
    ref = GatedRMSNorm(shape[-1], 1e-6).to(DEVICE)
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
