"""ops.router (Triton, run by the CPU interpreter here) against the eager router selection it replaces on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.router import entropy_sum, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


def _inputs(N, E, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, E, generator=gen) * 2).to(DEVICE).requires_grad_()
    bias = (torch.randn(E, generator=gen) * 0.3).to(DEVICE)
    d_scores = torch.randn(N, E, generator=gen).to(DEVICE)
    d_weights = torch.randn(N, k, generator=gen).to(DEVICE)
    return logits, bias, d_scores, d_weights


@pytest.mark.parametrize("N,E,k,n_group,topk_group", [(37, 32, 8, 1, 1), (20, 24, 6, 1, 1), (19, 32, 4, 4, 2)],
                         ids=["E32-top8", "E24-not-pow2", "4-groups-keep-2"])
def test_matches_eager_selection_and_gradients(N, E, k, n_group, topk_group):
    logits, bias, d_scores, d_weights = _inputs(N, E, k)
    got = route(logits, bias, k, n_group, topk_group, 2.446, fused=True)
    want = route(logits, bias, k, n_group, topk_group, 2.446, fused=False)
    assert torch.equal(got[1], want[1])  # the same experts, best first
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for grads in ((d_scores, d_weights), (None, d_weights)):  # with and without the aux loss's scores gradient
        outs = [(o, g) for o, g in zip((got[0], got[2]), grads) if g is not None]
        (d_got,) = torch.autograd.grad([o for o, _ in outs], logits, [g for _, g in outs], retain_graph=True)
        outs = [(o, g) for o, g in zip((want[0], want[2]), grads) if g is not None]
        (d_want,) = torch.autograd.grad([o for o, _ in outs], logits, [g for _, g in outs], retain_graph=True)
        torch.testing.assert_close(d_got, d_want, rtol=1e-5, atol=1e-6)


def test_group_limit_excludes_the_weaker_groups():
    """With 4 groups of 8 and topk_group=1 every chosen expert lies in the group whose two best
    (score + bias) values sum highest, even where a single expert elsewhere scores higher."""
    logits = torch.full((1, 32), -4.0, device=DEVICE)
    logits[0, 3] = 4.0  # the single best expert, in group 0
    logits[0, 17:19] = 3.0  # group 2's two best sum higher
    _, chosen, _ = route(logits, torch.zeros(32, device=DEVICE), 2, n_group=4, topk_group=1, fused=True)
    assert chosen.tolist() == [[17, 18]]


def test_ties_pick_the_lower_expert_first():
    scores_equal = torch.zeros(3, 16, device=DEVICE)
    _, chosen, weights = route(scores_equal, torch.zeros(16, device=DEVICE), 4, fused=True)
    assert chosen.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(weights, torch.full((3, 4), 0.25, device=DEVICE))


def test_nan_logits_still_choose_experts_in_range():
    """A diverged step's NaN logits must not send a token to a nonexistent expert (the dispatch would
    write out of bounds before the step is skipped): NaN lanes lose to every real value."""
    logits = torch.randn(4, 16, device=DEVICE)
    logits[0] = float("nan")
    logits[1, 5] = float("nan")
    _, chosen, _ = route(logits, torch.zeros(16, device=DEVICE), 4, fused=True)
    assert chosen.min() >= 0 and chosen.max() < 16
    assert chosen[0].tolist() == [0, 1, 2, 3] and 5 not in chosen[1].tolist()


def test_nan_logits_keep_topk_group_distinct_groups():
    """With group-limited routing a NaN row still keeps topk_group distinct groups and picks k distinct
    experts: here k = 6 needs both kept groups of 4. Row 0 is all NaN; row 1 has one real group (group
    0), so the second group kept is one of NaNs. (Two NaN lanes once summed to a -inf group score, tied
    with the group already taken: the same group was kept twice and expert 0 chosen three times.)"""
    logits = torch.full((2, 16), float("nan"), device=DEVICE)
    logits[1, :4] = torch.randn(4, device=DEVICE)
    _, chosen, _ = route(logits, torch.zeros(16, device=DEVICE), 6, n_group=4, topk_group=2, fused=True)
    for row in chosen.tolist():
        assert len(set(row)) == 6 and 0 <= min(row) and max(row) < 16, row
        assert len({e // 4 for e in row}) == 2, row
    assert set(chosen[1].tolist()) >= {0, 1, 2, 3}  # the real group is kept


def test_entropy_sum_matches_eager():
    scores = torch.sigmoid(torch.randn(70, 24, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    got, want = entropy_sum(scores, fused=True), entropy_sum(scores, fused=False)
    assert got[1].item() == want[1].item() == 70
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_the_router_runs_it(monkeypatch):
    """models.moe.Router takes its selection from ops.router: with the kernels forced on, the same
    experts, weights and router-weight gradient as its eager run."""
    import kimik3.models.moe as moe
    from kimik3.config.schema import ModelConfig

    torch.manual_seed(0)
    router = moe.Router(ModelConfig(hidden_size=16, num_experts=32, top_k=8, routed_scaling_factor=2.0)).to(DEVICE)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 16, device=DEVICE)

    def run():
        scores, chosen, weights = router(x)
        (grad,) = torch.autograd.grad((weights * torch.arange(8.0, device=DEVICE)).sum(), router.weight)
        return chosen, weights.detach(), grad

    want = run()
    calls = []
    monkeypatch.setattr(moe, "route", lambda *a: calls.append(1) or route(*a, fused=True))
    got = run()
    assert calls and torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
