"""models.loss.linear_cross_entropy against F.cross_entropy on full logits (fp64), forward and gradients;
its Triton row kernel (ops/cross_entropy.py, on the CPU interpreter here) against the eager rows."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import kimik3.models.loss as loss_module  # noqa: E402
from kimik3.models.loss import IGNORE_INDEX, linear_cross_entropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_runs = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs CUDA or the Triton interpreter")


def _inputs(N=37, D=16, V=50, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[[3, 20]] = IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets, z_weight):
    logits = hidden @ weight.T
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    z = torch.logsumexp(logits, -1)[targets != IGNORE_INDEX].pow(2).mean()
    return ce + z_weight * z, ce, z


@pytest.mark.parametrize("chunk_elems", [1 << 26, 7 * 50], ids=["one-chunk", "six-chunks"])
@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_matches_full_logits_in_fp64(monkeypatch, chunk_elems, z_weight):
    monkeypatch.setattr(loss_module, "_LOGIT_CHUNK_ELEMS", chunk_elems)
    hidden, weight, targets = _inputs()
    loss, ce, z = linear_cross_entropy(hidden, weight, targets, z_weight)
    want = _reference(hidden, weight, targets, z_weight)
    for got, ref in zip((loss, ce, z), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    assert not ce.requires_grad and not z.requires_grad
    scale = torch.tensor(3.0, dtype=torch.float64)  # the incoming gradient scales dh and dW
    got = torch.autograd.grad(loss * scale, (hidden, weight))
    ref = torch.autograd.grad(want[0] * scale, (hidden, weight))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-14)


def test_ignored_rows_get_no_gradient_and_all_ignored_gives_zero():
    hidden, weight, targets = _inputs()
    loss, _, _ = linear_cross_entropy(hidden, weight, targets, 1e-2)
    (d_hidden,) = torch.autograd.grad(loss, hidden)
    assert torch.all(d_hidden[[3, 20]] == 0) and torch.all(d_hidden[0] != 0)
    loss, ce, _ = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX))
    assert loss.item() == 0.0 and ce.item() == 0.0


def test_no_grad_and_one_side_frozen():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        loss, _, _ = linear_cross_entropy(hidden, weight, targets)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _reference(hidden, weight, targets, 0.0)[0], rtol=1e-12, atol=0)
    loss, _, _ = linear_cross_entropy(hidden, weight.detach(), targets)
    (d_hidden,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(d_hidden, torch.autograd.grad(_reference(hidden, weight.detach(), targets, 0.0)[0],
                                                             hidden)[0], rtol=1e-10, atol=1e-14)
    loss, _, _ = linear_cross_entropy(hidden.detach(), weight, targets)  # only the head trains
    (d_weight,) = torch.autograd.grad(loss, weight)
    torch.testing.assert_close(d_weight, torch.autograd.grad(_reference(hidden.detach(), weight, targets, 0.0)[0],
                                                             weight)[0], rtol=1e-10, atol=1e-14)


def test_runs_the_matmul_in_the_autocast_dtype():
    """Under bf16 autocast the head matmul runs in bf16 as F.linear would: the loss and gradients
    match the autocast reference to bf16 rounding, and the gradients keep the inputs' fp32 dtype."""
    hidden, weight, targets = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = linear_cross_entropy(hidden, weight, targets)
        logits = F.linear(hidden, weight)
    ref = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


def test_rejects_mismatched_shapes():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=r"hidden \(37, 16\), weight \(50, 8\)"):
        linear_cross_entropy(hidden, weight[:, :8], targets)


@triton_runs
@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_fused_rows_match_full_logits(monkeypatch, z_weight):
    """fp32 head: the kernel's loss and gradients against the fp64 full-logit reference, with rows
    spanning three vocab blocks (the last one partial) and two chunks of rows."""
    import kimik3.ops.cross_entropy as kernels

    monkeypatch.setattr(kernels, "BLOCK_V", 16)  # V = 40: blocks of 16, 16 and 8
    monkeypatch.setattr(loss_module, "_LOGIT_CHUNK_ELEMS", 20 * 40)
    hidden, weight, targets = _inputs(V=40, dtype=torch.float32)
    hidden, weight = (t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight))
    loss, ce, z = linear_cross_entropy(hidden, weight, targets.to(DEVICE), z_weight, fused=True)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    want = _reference(h64, w64, targets.to(DEVICE), z_weight)
    for got, ref in zip((loss, ce, z), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(loss, (hidden, weight))
    ref = torch.autograd.grad(want[0], (h64, w64))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-6)
    assert torch.all(got[0][[3, 20]] == 0)  # ignored targets


@triton_runs
def test_fused_rows_equal_the_eager_rows_in_bf16():
    """Under bf16 autocast both forms round the same fp32 gradient to bf16: the loss agrees to fp32
    rounding and the gradients to one bf16 rounding step of dlogits."""
    hidden, weight, targets = _inputs(N=64, D=32, V=300, dtype=torch.float32)
    hidden, weight, targets = (t.detach().to(DEVICE) for t in (hidden, weight, targets))
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss, _, _ = linear_cross_entropy(h, w, targets, 1e-3, fused=fused)
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, rtol=1e-2, atol=1e-5)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):  # the no-gradient kernel variant
        loss, _, _ = linear_cross_entropy(hidden, weight, targets, 1e-3, fused=True)
    torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
