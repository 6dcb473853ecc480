"""models.recompute.RecomputeSaved: saved activations replaced by a recipe, recomputed in backward."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.models.recompute import RecomputeSaved  # noqa: E402


def _grads(x, use_recompute):
    y = x * 2.0  # saves nothing
    recipe = RecomputeSaved(lambda: (x.detach() * 2.0,), (y,))
    with recipe if use_recompute else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        z = y.sin()  # saves y
    return torch.autograd.grad(z.sum(), x)[0], weakref.ref(y), z, recipe


def test_same_gradient_and_the_saved_tensor_is_freed():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    got, y_ref, z, recipe = _grads(x, True)
    want, _, _, _ = _grads(x, False)
    assert torch.equal(got, want)
    gc.collect()
    assert y_ref() is None  # the graph behind z kept the recipe, not y
    assert recipe._cache is None  # dropped once every saved output was handed back
    del z


def test_nothing_outlives_the_backward_without_the_cycle_collector():
    """Once the graph is gone, the recipe and fn's inputs are freed by reference counting alone (a
    hook-to-self cycle once pinned every layer's projection output for several training steps)."""
    gc.collect()
    gc.disable()
    try:
        base = torch.randn(6, 3, requires_grad=True)
        x = base * 1.0  # an activation fn reads, like the conv's input
        y = x * 2.0
        recipe = RecomputeSaved(lambda: (x.detach() * 2.0,), (y,))
        with recipe:
            z = y.sin()
        z.sum().backward()
        refs = weakref.ref(recipe), weakref.ref(x)
        del recipe, x, y, z
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_the_plain_run_keeps_it():
    """The control for the test above: without the recipe, the graph holds y."""
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = x * 2.0
    z = y.sin()
    y_ref = weakref.ref(y)
    del y
    gc.collect()
    assert y_ref() is not None and z.grad_fn is not None


def test_a_recompute_in_another_layout_is_refused():
    x = torch.randn(4, 4, requires_grad=True)
    y = (x * 2.0).t()
    with RecomputeSaved(lambda: ((x.detach() * 2.0),), (y,)):  # not transposed: another layout
        z = y.sin()
    with pytest.raises(RuntimeError, match="RecomputeSaved: output 0 was recomputed as"):
        z.sum().backward()


def test_off_inside_activation_checkpointing():
    x = torch.randn(3, requires_grad=True)
    states = []

    def block(x):
        y = x * 2.0
        recipe = RecomputeSaved(lambda: (x.detach() * 2.0,), (y,))
        states.append(recipe.active)
        with recipe:
            return y.sin()

    checkpoint(block, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(2.0 * x.detach()))
    assert states and not any(states)
    block(x)
    assert states[-1]


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
def test_kda_saves_the_conv_outputs_as_recipes():
    """The KDA mixer's use: the Triton KDA op's saved q, k, v become recipes over the Triton conv, and
    every gradient is bit-identical to keeping them."""
    from kimik3.ops.conv import causal_conv_silu
    from kimik3.ops.kda.function import triton_kda

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 20, 2, 16
    x = torch.randn(B, T, 3 * H * K, generator=gen).to(device).requires_grad_()
    w = (0.5 * torch.randn(3 * H * K, 1, 4, generator=gen)).to(device).requires_grad_()
    f, b = torch.randn(B, T, H, K, generator=gen).to(device), torch.randn(B, T, H, generator=gen).to(device)
    A_log, dt_bias = torch.zeros(H, device=device), torch.zeros(H * K, device=device)

    def run(use_recompute):
        def conv():
            return tuple(t.view(B, T, H, K) for t in causal_conv_silu(x, w, parts=3))

        q, k, v = conv()
        recipe = RecomputeSaved(conv, (q, k, v))
        with recipe if use_recompute else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            o, _ = triton_kda(q, k, v, f, b, A_log, dt_bias)
        return torch.autograd.grad(o.square().sum(), (x, w)), recipe

    (got, recipe), (want, _) = run(True), run(False)
    assert recipe._packed == {0, 1, 2}
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_off_and_traceable_under_torch_compile():
    """train.compile=true: the compiler decides what to save, so the recipe stays off and does not
    break the graph (fullgraph=True raises on a graph break)."""
    def f(x, w):
        y = x @ w
        with RecomputeSaved(lambda: ((x @ w).detach(),), (y,)):
            return y.sin().sum()

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x, w), (x, w))
    for g, e in zip(got, torch.autograd.grad(f(x, w), (x, w))):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("on", [False, True])
def test_the_trainer_switches_reach_every_kda_mixer_and_moe(on):
    from kimik3.config.schema import ModelConfig, TrainConfig
    from kimik3.models import build_model
    from kimik3.models.kda import KDAMixer
    from kimik3.models.moe import MoE
    from kimik3.trainer import prepare_for_training

    model = build_model(ModelConfig(num_layers=4, mla_every=4), 64)
    prepare_for_training(model, TrainConfig(device="cpu", recompute_conv=on, recompute_experts=not on,
                                            recompute_kda_states=not on))
    mixers = [m for m in model.modules() if isinstance(m, KDAMixer)]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(mixers) == 3 and all(m.recompute_conv is on for m in mixers)
    assert all(m.recompute_kda_states is (not on) for m in mixers)
    assert len(moes) == 3 and all(m.recompute_experts is (not on) for m in moes)


@pytest.mark.parametrize("recompute", [False, True, None])
def test_kda_mixers_hand_the_state_switch_to_the_triton_op(monkeypatch, recompute):
    """train.recompute_kda_states=false reaches the Triton KDA op of every mixer as keep_states=True,
    true as False, and null (auto) as True at this tiny size.

    On CUDA where there is one: on a GPU machine the kernels are compiled, not interpreted, so a CPU
    model there would run the `chunk` fallback instead of the op under test."""
    import kimik3.models.kda as kda_module
    from kimik3.config.schema import ModelConfig, TrainConfig
    from kimik3.models import build_model
    from kimik3.trainer import prepare_for_training

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = []
    real = kda_module.kda
    monkeypatch.setattr(kda_module, "kda", lambda *a, **k: seen.append((k["impl"], k["keep_states"])) or real(*a, **k))
    model = build_model(ModelConfig(num_layers=2, mla_every=0, num_experts=0, kda_implementation="triton"), 64)
    model.to(device)
    prepare_for_training(model, TrainConfig(device=device, recompute_kda_states=recompute))
    model(torch.randint(0, 64, (1, 40), device=device))
    assert seen == [("triton", recompute is not True)] * 2


def test_auto_keeps_kda_states_up_to_the_size_cap():
    """train.recompute_kda_states=null keeps a layer's chunk states while [B * ceil(T / 64), H, K, V]
    in the activations' dtype fits KEEP_KDA_STATES_MAX_BYTES: kda_dense_1b's 16 heads x 128 keep them
    up to 16K bf16 tokens per micro-batch (64 MiB at 8K, 128 MiB at 16K) and recompute at 32K; a forced
    setting ignores the size."""
    from kimik3.config.schema import ModelConfig
    from kimik3.models.kda import KEEP_KDA_STATES_MAX_BYTES, KDAMixer

    mixer = KDAMixer(ModelConfig(hidden_size=256, num_heads=16, head_dim=128))
    assert KEEP_KDA_STATES_MAX_BYTES == 128 * 2**20
    bf16 = 2
    assert mixer.keeps_kda_states(1, 8192, bf16) and mixer.keeps_kda_states(2, 8192, bf16)
    assert mixer.keeps_kda_states(1, 16384, bf16) and not mixer.keeps_kda_states(1, 16385, bf16)
    assert not mixer.keeps_kda_states(1, 32768, bf16) and not mixer.keeps_kda_states(4, 8192, bf16)
    assert not mixer.keeps_kda_states(1, 16384, 4)  # fp32 activations: twice the bytes
    mixer.recompute_kda_states = False
    assert mixer.keeps_kda_states(1, 32768, bf16)
    mixer.recompute_kda_states = True
    assert not mixer.keeps_kda_states(1, 64, bf16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the mixer's Triton conv path)")
def test_model_gradients_are_identical_with_and_without_recompute():
    from kimik3.config.schema import ModelConfig
    from kimik3.models import build_model

    grads = []
    # (train.recompute_conv, train.recompute_kda_states): neither, the conv outputs, and both recomputed
    for conv_on, states_on in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        # KDA and dense FFN layers only: both paths are deterministic, so the gradients must match bit for bit
        model = build_model(ModelConfig(num_layers=3, mla_every=0, num_experts=0, kda_implementation="triton"),
                            64).cuda()
        for m in model.modules():
            if hasattr(m, "recompute_conv"):
                m.recompute_conv, m.recompute_kda_states = conv_on, states_on
        x = torch.randint(0, 64, (2, 97), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        model(x[:, :-1], x[:, 1:]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert torch.equal(other[name], g), name
