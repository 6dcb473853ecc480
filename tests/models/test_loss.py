"""models.loss.linear_cross_entropy against F.cross_entropy on full logits (fp64), forward and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kimik3.models.loss as loss_module
from kimik3.models.loss import IGNORE_INDEX, linear_cross_entropy


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
