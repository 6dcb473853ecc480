"""MoE DispatchRows: the gather to expert order and its sort-free backward equal plain indexing."""

from __future__ import annotations

import torch

from kimik3.models.moe import DispatchRows


def test_dispatch_rows_matches_indexing() -> None:
    gen = torch.Generator().manual_seed(0)
    N, k, D = 7, 3, 5
    x = torch.randn(N, D, generator=gen, dtype=torch.float64, requires_grad=True)
    order = torch.argsort(torch.randint(0, 4, (N * k,), generator=gen), stable=True)
    grad = torch.randn(N * k, D, generator=gen, dtype=torch.float64)
    got = DispatchRows.apply(x, order, k)
    want = x[order // k]
    assert torch.equal(got, want)
    (g_got,) = torch.autograd.grad(got, x, grad)
    (g_want,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(g_got, g_want)
