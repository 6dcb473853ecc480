"""MoE: sorted dispatch vs a per-token loop, routing rules, aux-loss-free bias balancing, diagnostics."""

from __future__ import annotations

import copy
import pytest
import torch
import torch.nn.functional as F

from kimik3.config.schema import ModelConfig
from kimik3.models.moe import MoE
from kimik3.ops.compare import rel_rms_error

D, E, I = 16, 8, 12


def _moe(**overrides) -> MoE:
    base = dict(hidden_size=D, num_experts=E, top_k=2, moe_intermediate_size=I, num_shared_experts=1,
                routed_scaling_factor=2.5)
    torch.manual_seed(0)
    moe = MoE(ModelConfig(**{**base, **overrides})).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Route and run each token on its own, straight from the router equations."""
    bias = moe.router.e_score_correction_bias
    out = torch.zeros_like(x)
    for n, token in enumerate(x):
        scores = torch.sigmoid(moe.router.weight @ token)  # [E]
        chosen = torch.topk(scores + bias, moe.top_k).indices
        weights = scores[chosen] / scores[chosen].sum() * moe.router.routed_scaling_factor
        for w, e in zip(weights, chosen):
            gate, up = (moe.experts.gate_up_proj[e] @ token).chunk(2)
            out[n] += w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
        if moe.shared_experts is not None:
            s = moe.shared_experts
            out[n] += s.down_proj.weight @ (F.silu(s.gate_proj.weight @ token) * (s.up_proj.weight @ token))
    return out


@pytest.mark.parametrize("shared", [1, 0], ids=["shared", "no-shared"])
def test_dispatch_matches_per_token_loop(shared):
    moe = _moe(num_shared_experts=shared)
    with torch.no_grad():
        moe.router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))  # bias steers the choice
    x = torch.randn(3, 7, D, dtype=torch.float64)
    y, aux = moe(x)
    assert aux is None
    assert torch.allclose(y.view(-1, D), _per_token_reference(moe, x.view(-1, D)), rtol=1e-10, atol=1e-10)


def test_dispatch_gradients_match_per_token_loop():
    moe = _moe()
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    params = [x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    g_fast = torch.autograd.grad(moe(x)[0].pow(2).sum(), params)
    g_ref = torch.autograd.grad(_per_token_reference(moe, x.view(-1, D)).pow(2).sum(), params)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)


def test_router_scores_in_fp32_under_autocast():
    """The routing decision and weights stay fp32 under bf16 autocast (the same as outside it)."""
    moe = _moe().float()
    x = torch.randn(9, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, chosen, weights = moe.router(x)
    want_scores, want_chosen, want_weights = moe.router(x)
    assert scores.dtype == weights.dtype == torch.float32
    assert torch.equal(scores, want_scores) and torch.equal(chosen, want_chosen) and torch.equal(weights, want_weights)


def test_group_limited_routing_picks_only_from_best_groups():
    moe = _moe(n_group=4, topk_group=2, top_k=3)
    x = torch.randn(64, D, dtype=torch.float64)
    scores, chosen, weights = moe.router(x)
    groups = scores.view(64, 4, 2)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [N, 2] allowed groups
    assert bool((chosen // 2)[..., None].eq(best[:, None, :]).any(-1).all())
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5, dtype=torch.float64))


@pytest.mark.parametrize("n_group, topk_group, top_k", [
    (4, 1, 3),  # the kept group holds 2 experts: top-k would take experts of the groups it left out
    (8, 2, 2),  # groups of 1 expert: a group is ranked by its two best scores
], ids=["top_k_past_the_kept_groups", "one_expert_groups"])
def test_group_limited_routing_that_cannot_work_is_refused(n_group, topk_group, top_k):
    with pytest.raises(ValueError, match=f"model.top_k={top_k}, n_group={n_group}, topk_group={topk_group}"):
        _moe(n_group=n_group, topk_group=topk_group, top_k=top_k)


def test_top_k_may_take_every_expert_of_the_kept_groups():
    moe = _moe(n_group=4, topk_group=2, top_k=4)
    scores, chosen, _ = moe.router(torch.randn(32, D, dtype=torch.float64))
    groups = (chosen // 2).sort(-1).values  # 2 experts a group: each kept group fully, twice
    assert torch.equal(groups[:, 0::2], groups[:, 1::2]) and bool((groups[:, 0] != groups[:, 2]).all())


def test_bias_update_moves_load_towards_uniform():
    """A router skewed towards two experts: the sign rule (bias += rate * sign(mean - load))
    evens the load out over steps, and a skipped step resets the counts without moving the bias."""
    # Grad mode stays on (only such forwards count load), but with no parameter needing a gradient
    # no graph is built: each forward costs what a no-grad one does.
    moe = _moe(bias_update_rate=0.02).train().requires_grad_(False)
    with torch.no_grad():
        moe.router.weight[:2] += 0.3  # with positive-mean tokens, experts 0 and 1 attract most of them
    x = 0.5 + 0.3 * torch.randn(256, 1, D, dtype=torch.float64)

    def imbalance() -> float:
        moe(x)
        moe.commit_stats()
        load = moe.step_load.clone()
        moe.end_step(applied=True)
        return (load.max() / load.mean()).item()

    before = imbalance()
    for _ in range(60):
        after = imbalance()
    assert before > 2.0 and after < 0.6 * before

    bias = moe.router.e_score_correction_bias.clone()
    moe(x)
    moe.commit_stats()
    moe.end_step(applied=False)
    assert torch.equal(moe.router.e_score_correction_bias, bias) and moe.step_load.sum() == 0
    moe(x)  # the trainer's device flag: False moves nothing either, True as much as applied=True
    moe.commit_stats()
    moe.end_step(applied=torch.tensor(False))
    assert torch.equal(moe.router.e_score_correction_bias, bias) and moe.step_load.sum() == 0
    twin = copy.deepcopy(moe)
    for m, applied in ((moe, True), (twin, torch.tensor(True))):
        m(x)
        m.commit_stats()
        m.end_step(applied=applied)
    assert not torch.equal(moe.router.e_score_correction_bias, bias)
    assert torch.equal(twin.router.e_score_correction_bias, moe.router.e_score_correction_bias)


@pytest.mark.parametrize("mode, grad", [("eval", False), ("eval", True), ("train", False)])
def test_only_training_forwards_with_grad_count_load(mode, grad):
    moe = _moe()
    x = torch.randn(2, 4, D, dtype=torch.float64)
    moe.train()(x)  # a training forward leaves its counts pending ...
    with torch.set_grad_enabled(grad):
        moe.train(mode == "train")(x)  # ... which any other forward drops, adding none of its own
    moe.commit_stats()
    assert moe.step_load.sum() == 0 and moe.step_entropy.sum() == 0
    moe.train()(x)
    moe.commit_stats()
    assert moe.step_load.sum() == 2 * 4 * moe.top_k


def test_sequence_aux_loss_is_one_when_balanced_and_has_gradients():
    """f_e * P_e summed: exactly 1 for uniform routing; larger when skewed; differentiable."""
    moe = _moe(aux_loss_weight=1.0).train()
    with torch.no_grad():
        moe.router.weight.zero_()  # all scores 0.5: P_e = 1/E; ties break to the same experts though
    x = torch.randn(2, 8, D, dtype=torch.float64)
    _, aux_tied = moe(x)
    assert aux_tied.item() == pytest.approx(1.0)  # P uniform -> sum_e f_e / E = 1 whatever f is
    moe = _moe(aux_loss_weight=1.0).train()
    _, aux = moe(x)
    assert aux.item() > 0
    (grad,) = torch.autograd.grad(aux, moe.router.weight)
    assert grad.abs().sum() > 0


def test_diagnostics_report_load_entropy_and_bias():
    moe = _moe().train()
    moe(torch.randn(4, 8, D, dtype=torch.float64))
    moe.commit_stats()
    before = moe.diagnostics("moe/layer1")
    moe.end_step(applied=True)
    after = moe.diagnostics("moe/layer1")  # trackers reset: reports the finished step
    assert set(before) == {"moe/layer1/bias_norm", "moe/layer1/load_min", "moe/layer1/load_max",
                           "moe/layer1/router_entropy"}
    assert before["moe/layer1/load_min"] == after["moe/layer1/load_min"] <= 1.0 <= after["moe/layer1/load_max"]
    assert 0 < after["moe/layer1/router_entropy"] <= torch.log(torch.tensor(float(E))).item() + 1e-6
    assert after["moe/layer1/bias_norm"] > 0 == before["moe/layer1/bias_norm"]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_grouped_mm_path_matches_expert_loop():
    """The bf16 grouped-GEMM experts (torch._grouped_mm: CUDA in training, its CPU kernel here) equal
    the per-expert loop (same bf16 inputs) to bf16 rounding, forward and backward; one expert gets
    no tokens."""
    moe = _moe(hidden_size=64, moe_intermediate_size=32).float().to(DEVICE)
    x = torch.randn(300, 64, device=DEVICE, dtype=torch.bfloat16)
    counts = torch.tensor([40, 0, 100, 60, 30, 20, 40, 10], device=DEVICE)
    experts = moe.experts
    fast = experts._grouped(x.requires_grad_(), counts, experts.grouped_weights())
    (dx_fast,) = torch.autograd.grad(fast.float().pow(2).sum(), x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ref = experts._looped(x, counts)
    (dx_ref,) = torch.autograd.grad(ref.float().pow(2).sum(), x)
    assert rel_rms_error(fast, ref) < 1e-2 and rel_rms_error(dx_fast, dx_ref) < 2e-2


def test_recomputed_expert_inputs_give_identical_gradients(monkeypatch):
    """train.recompute_experts: the dispatched rows and the bf16 expert weights the grouped GEMMs save
    become recipes (all three are used), and every gradient is bit-identical to keeping them."""
    import kimik3.models.moe as moe_module

    recipes = []

    class Spy(moe_module.RecomputeSaved):
        def __init__(self, *args):
            super().__init__(*args)
            recipes.append(self)

    monkeypatch.setattr(moe_module, "_use_grouped_mm", lambda x: True)  # the grouped path on any device
    monkeypatch.setattr(moe_module, "RecomputeSaved", Spy)
    grads = []
    for on in (False, True):
        moe = _moe(hidden_size=64, moe_intermediate_size=32).float().to(DEVICE).train()
        moe.recompute_experts = on
        x = torch.randn(50, 64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1), requires_grad=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):  # the grouped GEMMs' bf16 compute, as in training
            y, _ = moe(x[None])
        y.float().pow(2).sum().backward()
        grads.append({"x": x.grad, **{n: p.grad for n, p in moe.named_parameters() if p.grad is not None}})
    assert len(recipes) == 1 and recipes[0]._packed == {0, 1, 2} and recipes[0]._cache is None
    assert grads[0].keys() == grads[1].keys() and "experts.gate_up_proj" in grads[0]
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name
