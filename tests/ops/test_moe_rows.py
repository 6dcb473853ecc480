"""ops.moe_rows: the MoE's row permutations against plain indexing, and the Triton kernels (run by
the CPU interpreter here) against the eager form, forward and gradients."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.moe_rows import combine_rows, dispatch_rows, invert_permutation, sort_by_expert  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_runs = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs CUDA or the Triton interpreter")


def _routing(N=7, k=3, E=4, D=1500, dtype=torch.float64, seed=0):
    """Token rows, a routing sorted by expert (as MoE.forward builds it) and its weights. D above the
    kernels' 1024-wide block, so a row spans two blocks with a masked tail."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
    order = torch.argsort(torch.randint(0, E, (N * k,), generator=gen), stable=True).to(DEVICE)
    weights = torch.rand(N, k, generator=gen, dtype=torch.float32).to(DEVICE).requires_grad_()
    return x, order, invert_permutation(order), weights


def test_invert_permutation():
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3))
    slot_of = invert_permutation(order)
    assert torch.equal(slot_of[order], torch.arange(50)) and torch.equal(order[slot_of], torch.arange(50))


def test_eager_dispatch_and_combine_match_indexing():
    x, order, slot_of, weights = _routing()
    N, k = weights.shape
    routed = dispatch_rows(x, order, slot_of, k, fused=False)
    assert torch.equal(routed, x[order // k])
    y = combine_rows(routed * 2, order, slot_of, weights.double(), fused=False)
    want = 2 * (weights.double()[..., None] * x[:, None, :]).sum(1)  # each token's own rows come back
    torch.testing.assert_close(y, want)
    grad = torch.randn_like(routed)
    torch.testing.assert_close(torch.autograd.grad(routed, x, grad)[0],
                               torch.autograd.grad(x[order // k], x, grad)[0])


@triton_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_eager(dtype):
    """Same values and gradients (x, routed, weights) as the eager path in fp32; in bf16 both are held
    against an fp64 run on the same inputs, the kernels (fp32 sums) at least as close as the eager
    form (its products round to bf16 first: the weights' gradient, a 1500-term dot, is off by up to
    ~20% of small entries on the H200)."""
    x, order, slot_of, weights = _routing(dtype=dtype)
    N, k = weights.shape
    gen = torch.Generator().manual_seed(5)
    expert = torch.randn(x.shape[1], generator=gen, dtype=torch.float32).to(DEVICE, dtype)  # stands in for the experts
    dy = torch.randn(N, x.shape[1], generator=gen, dtype=torch.float32).to(DEVICE, dtype)

    def run(x, weights, expert, dy, fused):
        routed = dispatch_rows(x, order, slot_of, k, fused=fused) * expert
        y = combine_rows(routed, order, slot_of, weights, fused=fused)
        return (y, *torch.autograd.grad(y, (x, weights), dy))

    fused, eager = run(x, weights, expert, dy, True), run(x, weights, expert, dy, False)
    assert torch.equal(dispatch_rows(x, order, slot_of, k, fused=True), x[order // k])  # the gather: exact
    if dtype == torch.float32:
        for got, want in zip(fused, eager):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weights))
    exact = run(x64, w64, expert.double(), dy.double(), False)
    for got, other, ref in zip(fused, eager, exact):
        assert got.dtype == other.dtype
        scale = ref.abs().max()
        assert (got.double() - ref).abs().max() <= max(1.01 * (other.double() - ref).abs().max(), 1e-2 * scale)
        assert (got.double() - ref).abs().max() <= 2e-2 * scale


@triton_runs
@pytest.mark.parametrize("plus_dtype", [torch.bfloat16, None], ids=["plus-bf16", "no-plus"])
def test_fused_combine_widens_and_adds_plus_as_eager_ops_would(plus_dtype):
    """combine_rows(..., plus=s, out_dtype=fp32) on bf16 rows (the MoE under autocast: routed experts'
    rows, the shared experts' output) equals the separate ops `combine.to(fp32) + s`, forward and
    gradients of routed, weights and s, bit for bit."""
    x, order, slot_of, weights = _routing(dtype=torch.bfloat16)
    N, k = weights.shape
    gen = torch.Generator().manual_seed(8)
    routed = dispatch_rows(x, order, slot_of, k, fused=True).detach().requires_grad_()
    plus = (torch.randn(N, x.shape[1], generator=gen).to(DEVICE, plus_dtype).requires_grad_()
            if plus_dtype is not None else None)
    dy = torch.randn(N, x.shape[1], generator=gen).to(DEVICE)
    y = combine_rows(routed, order, slot_of, weights, plus=plus, out_dtype=torch.float32, fused=True)
    y_sep = combine_rows(routed, order, slot_of, weights, fused=True).to(torch.float32)
    if plus is not None:
        y_sep = y_sep + plus
    assert y.dtype == y_sep.dtype == torch.float32 and torch.equal(y, y_sep)
    wrt = (routed, weights) + ((plus,) if plus is not None else ())
    for got, want in zip(torch.autograd.grad(y, wrt, dy), torch.autograd.grad(y_sep, wrt, dy)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@triton_runs
@pytest.mark.parametrize("M,E", [(7, 3), (2500, 32), (256 * 70 + 5, 24)],
                         ids=["tiny", "E32-ten-blocks", "71-blocks-E24"])
def test_sort_by_expert_kernels_match_the_stable_argsort(M, E):
    """The two-launch sort gives torch's stable argsort, its inverse and the counts exactly, past one
    load of 64 histogram rows, with E not a power of two and experts that get no pair."""
    gen = torch.Generator().manual_seed(M)
    expert_of = torch.randint(0, E - 1, (M,), generator=gen).to(DEVICE)  # expert E - 1 gets none
    got, want = sort_by_expert(expert_of, E, fused=True), sort_by_expert(expert_of, E, fused=False)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
    assert got[2][-1] == 0 and torch.equal(expert_of[got[0]], expert_of.sort(stable=True).values)


def test_sort_by_expert_of_no_pairs_gives_zero_counts():
    order, slot_of, counts = sort_by_expert(torch.zeros(0, dtype=torch.long, device=DEVICE), 4, fused=True)
    assert order.numel() == slot_of.numel() == 0 and counts.tolist() == [0, 0, 0, 0]


@triton_runs
def test_the_moe_sorts_through_it(monkeypatch):
    """models.moe.MoE takes its dispatch order from ops.moe_rows.sort_by_expert: with the kernels forced
    on, the layer's output and gradients are bit-identical to its eager run."""
    import kimik3.models.moe as moe
    from kimik3.config.schema import ModelConfig

    torch.manual_seed(0)
    layer = moe.MoE(ModelConfig(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8)).to(DEVICE).train()
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 9, 16, device=DEVICE)

    def run():
        y, _ = layer(x)
        return y.detach(), torch.autograd.grad(y.square().sum(), list(layer.parameters()), allow_unused=True)

    want = run()
    calls = []
    monkeypatch.setattr(moe, "sort_by_expert", lambda e, n: calls.append(n) or sort_by_expert(e, n, fused=True))
    got = run()
    assert calls == [8] and torch.equal(got[0], want[0])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[1], want[1]))
