"""Whole-model behaviour of KimiK3: causality, loss, implementations, hooks, layer pattern."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import kimik3.models.blocks as blocks_module  # noqa: E402
import kimik3.models.loss as loss_module  # noqa: E402
from kimik3.config.schema import ModelConfig  # noqa: E402
from kimik3.models import build_model  # noqa: E402
from kimik3.models.blocks import resolve_layer_types  # noqa: E402
from kimik3.models.kimi_k3 import KimiK3  # noqa: E402
from kimik3.models.loss import linear_cross_entropy  # noqa: E402
from kimik3.models.moe import MoE  # noqa: E402
from kimik3.ops.compare import rel_rms_error  # noqa: E402

VOCAB = 50


def _cfg(**overrides) -> ModelConfig:
    base = dict(hidden_size=32, num_layers=4, mla_every=2, num_heads=2, head_dim=8, kda_chunk_size=8,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
                num_experts=4, top_k=2, moe_intermediate_size=16, first_k_dense=1)
    return ModelConfig(**{**base, **overrides})


def _model(**overrides) -> KimiK3:
    torch.manual_seed(0)
    return build_model(_cfg(**overrides), VOCAB).double()


def _tokens(B=2, T=21, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["chunk", "naive"])
def test_changing_a_future_token_never_changes_the_past(impl):
    model = _model(kda_implementation=impl).eval()
    x = _tokens(B=1)
    t = 9
    x2 = x.clone()
    x2[0, t + 1] = (x[0, t + 1] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x).logits, model(x2).logits
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_chunk_and_naive_models_agree():
    x = _tokens()
    with torch.no_grad():
        chunk = _model(kda_implementation="chunk").eval()(x).logits
        naive = _model(kda_implementation="naive").eval()(x).logits
    assert torch.allclose(chunk, naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_elems", [1 << 25, 3 * VOCAB], ids=["one-chunk", "many-chunks"])
def test_chunked_loss_equals_full_cross_entropy_and_z_loss(monkeypatch, chunk_elems):
    """loss = CE + z_weight * mean(lse^2) + aux, with gradients equal to the unchunked form."""
    monkeypatch.setattr(loss_module, "_LOGIT_CHUNK_ELEMS", chunk_elems)
    model = _model(z_loss_weight=1e-2, aux_loss_weight=0.0).train()
    x, y = _tokens(), _tokens(seed=2)
    y[0, 3] = -100  # ignored target
    out = model(x, y)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))

    logits = model(x).logits.flatten(0, 1)
    ce = F.cross_entropy(logits, y.flatten(), ignore_index=-100)
    lse = torch.logsumexp(logits, -1)[y.flatten() != -100]
    expected = ce + 1e-2 * lse.pow(2).mean()
    assert torch.allclose(out.lm_loss, ce, rtol=1e-12) and torch.allclose(out.loss, expected, rtol=1e-12)
    for g, e in zip(grads, torch.autograd.grad(expected, list(model.parameters()))):
        assert torch.allclose(g, e, rtol=1e-9, atol=1e-12)


def _unfused_loss(model: KimiK3, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's loss as each block computed it before its residual adds moved into the next norm:
    x + mixer(norm(x)), then x + ffn(norm(x)), eager adds and eager norms."""
    h, aux = model.embed(x), []
    for layer in model.layers:
        h = h + layer.attn(layer.attn_norm(h))
        out = layer.ffn(layer.ffn_norm(h))
        if isinstance(layer.ffn, MoE):
            out, a = out
            aux += [a] if a is not None else []
        h = h + out
    loss, _, _ = linear_cross_entropy(model.norm(h).flatten(0, 1), model.lm_head.weight, y.flatten(),
                                      model.cfg.z_loss_weight)
    return loss + torch.stack(aux).sum() if aux else loss


@pytest.mark.parametrize("mode", ["eager", "eager-checkpointed", "fused"])
def test_residual_adds_fused_into_norms_keep_loss_and_gradients(monkeypatch, mode):
    """Blocks hand their residual adds to the next norm (RMSNorm.add_forward): the loss and every
    parameter gradient equal the unfused block math; bit for bit on the eager path (fp64), to fp32
    rounding with every RMSNorm and add as ops.norm's Triton kernels (on CUDA, else the CPU interpreter)."""
    fused = mode == "fused"
    if fused and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or the Triton interpreter")
    device = "cuda" if fused and torch.cuda.is_available() else "cpu"  # the kernels run natively there
    torch.manual_seed(0)
    model = build_model(_cfg(aux_loss_weight=1e-3, z_loss_weight=1e-2), VOCAB).train()
    model = (model.float() if fused else model.double()).to(device)
    x, y = _tokens().to(device), _tokens(seed=2).to(device)
    params = list(model.parameters())
    expected = _unfused_loss(model, x, y)
    expected_grads = torch.autograd.grad(expected, params)
    model.checkpoint_blocks = mode == "eager-checkpointed"
    if fused and device == "cpu":  # the CUDA branch of RMSNorm on CPU tensors, by the interpreter
        monkeypatch.setattr(blocks_module, "takes_fused_norm",
                            lambda *ts: all(t.dtype == torch.float32 for t in ts))
    loss = model(x, y).loss
    grads = torch.autograd.grad(loss, params)
    if not fused:
        assert torch.equal(loss, expected)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
        return
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * e.abs().max().item())


def test_backward_reaches_every_parameter():
    model = _model(aux_loss_weight=1e-3).train()
    out = model(_tokens(), _tokens(seed=2))
    assert out.loss > out.lm_loss  # the aux loss is added
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_step_hooks_update_bias_and_reset_trackers():
    model = _model().train()
    for _, mla in model.mla_layers():
        mla.track_max_logits = True
    model(_tokens(), _tokens(seed=2)).loss.backward()
    diag = model.diagnostics()
    assert {"moe/layer1/load_max", "moe/layer3/router_entropy", "mla/layer1/max_logit", "mla/layer3/max_logit"} <= set(diag)
    biases = [moe.router.e_score_correction_bias.clone() for _, moe in model.moe_layers()]

    model.on_step_end(applied=False)  # a skipped step: no bias move, trackers reset
    assert all(torch.equal(b, moe.router.e_score_correction_bias) for b, (_, moe) in zip(biases, model.moe_layers()))
    assert all(torch.isinf(mla.max_logits).all() for _, mla in model.mla_layers())
    assert model.diagnostics()["mla/layer1/max_logit"] == diag["mla/layer1/max_logit"]  # last step's

    model(_tokens(), _tokens(seed=2))
    model.on_step_end(applied=True)
    assert all(not torch.equal(b, moe.router.e_score_correction_bias) for b, (_, moe) in zip(biases, model.moe_layers()))


def test_triton_on_cpu_falls_back_to_chunk_with_one_log_line(caplog, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = _tokens()
    with torch.no_grad():
        expected = _model(kda_implementation="chunk").eval()(x).logits
        with caplog.at_level(logging.WARNING, logger="kimik3.models.kda"):
            got = _model(kda_implementation="triton").eval()(x).logits
    assert torch.equal(got, expected)
    assert sum("kda_implementation=triton needs CUDA" in r.message for r in caplog.records) <= 1


def test_tied_embeddings_share_one_tensor():
    model = _model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({"num_layers": 8, "mla_every": 4}, ["kda", "kda", "kda", "mla"] * 2),
        ({"num_layers": 6, "mla_every": 4}, ["kda", "kda", "kda", "mla", "kda", "mla"]),
        ({"num_layers": 3, "mla_every": 0}, ["kda"] * 3),
        ({"num_layers": 3, "mla_every": 1}, ["mla"] * 3),
        ({"num_layers": 2, "layer_types": ["mla", "kda"]}, ["mla", "kda"]),
    ],
    ids=["every-4th", "last-is-mla", "kda-only", "mla-only", "explicit"],
)
def test_layer_pattern(overrides, expected):
    assert resolve_layer_types(_cfg(**overrides)) == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"num_layers": 3, "layer_types": ["kda", "mla"]}, "has 2 entries but model.num_layers=3"),
        ({"num_layers": 2, "layer_types": ["kda", "gla"]}, r"contains \['gla'\]"),
        ({"mla_every": -1}, "mla_every=-1"),
    ],
)
def test_bad_layer_pattern_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_layer_types(_cfg(**overrides))


@pytest.mark.parametrize("overrides", [{"mla_every": 0, "num_experts": 0}, {"mla_every": 1}], ids=["kda-dense", "mla-only"])
def test_single_mixer_models_train(overrides):
    model = _model(**overrides).train()
    model(_tokens(), _tokens(seed=2)).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_trains_under_bf16_autocast():
    torch.manual_seed(0)
    model = build_model(_cfg(), VOCAB).float()
    x, y = _tokens(), _tokens(seed=2)
    with torch.no_grad():
        cpu = model(x).logits
        model.cuda()
        gpu = model(x.cuda()).logits.cpu()
    assert rel_rms_error(gpu, cpu) < 1e-4
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.train()(x.cuda(), y.cuda())
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    full = model(x.cuda(), y.cuda()).lm_loss
    assert abs(out.lm_loss.item() - full.item()) < 0.02 * full.item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bf16_operands_train_exactly_as_autocast_casts_them(monkeypatch, device):
    """Under bf16 autocast the model hands its matmuls bf16 operands itself: every projection's weight
    through ops.cast (the vectorised gradient cast on CUDA), the norms in front of a single GEMM in
    bf16 (RMSNorm.feeds_matmul), the MoE's dispatch and shared experts one bf16 copy (ops.cast.bf16_uses).
    Loss and gradients equal letting autocast cast everything itself (weights fp32, norms returning
    fp32, a cast per consumer): bit for bit on CPU; on CUDA the MoE's input gradients are summed in
    another order (fp32 sums round differently), so to a relative RMS error of 1e-3."""
    import kimik3.models.blocks as blocks_module
    import kimik3.models.moe as moe_module
    from kimik3.ops import cast as cast_module

    torch.manual_seed(0)
    model = build_model(_cfg(), VOCAB).float().to(device)
    x, y = _tokens().to(device), _tokens(seed=2).to(device)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x, y)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    casts, norm_outputs = [], []
    monkeypatch.setattr(cast_module._BF16Weight, "forward", _counting(cast_module._BF16Weight.forward, casts))
    # stacked projections on CUDA: their weights cast and stacked in one launch (ops.cast.autocast_stacked)
    monkeypatch.setattr(cast_module._BF16Stacked, "forward",
                        _counting(cast_module._BF16Stacked.forward, casts, weights=lambda args: args[1:]))
    hooks = [m.register_forward_hook(lambda m, args, out: norm_outputs.append(out.dtype))
             for m in model.modules() if isinstance(m, blocks_module.RMSNorm) and m.feeds_matmul]
    loss, grads = loss_and_grads()
    for hook in hooks:
        hook.remove()
    projections = [m for m in model.modules() if isinstance(m, blocks_module.Linear)]
    assert len(casts) >= len(projections) > 0  # each projection's weight (and the experts') went through it
    assert norm_outputs and set(norm_outputs) == {torch.bfloat16}
    monkeypatch.setattr(blocks_module, "autocast_weight", lambda w: w)
    monkeypatch.setattr(blocks_module, "autocast_stacked", lambda weights: torch.cat(list(weights)))
    monkeypatch.setattr(blocks_module, "autocast_dtype", lambda device_type: None)
    monkeypatch.setattr(moe_module, "bf16_uses", lambda t, uses: tuple(t.to(torch.bfloat16) for _ in range(uses)))
    want_loss, want_grads = loss_and_grads()
    assert grads.keys() == want_grads.keys()
    if device == "cpu":
        assert torch.equal(loss, want_loss)
        for name, g in grads.items():
            assert torch.equal(g, want_grads[name]), name
        return
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    for name, g in grads.items():
        assert rel_rms_error(g, want_grads[name]) < 1e-3, name


def _counting(forward, calls: list, weights=lambda args: args[:1]):
    """forward of an autograd Function that also records the shape of each weight it casts
    (`weights` picks them from the forward's arguments: the first, unless told otherwise)."""
    def counted(ctx, *args):
        calls.extend(w.shape for w in weights(args))
        return forward(ctx, *args)
    return staticmethod(counted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_matches_chunk_on_cuda():
    pytest.importorskip("fla.ops.kda")
    x = _tokens(T=64).cuda()
    with torch.no_grad():
        ref = _model(kda_implementation="chunk", head_dim=16).float().cuda().eval()(x).logits
        fla = _model(kda_implementation="fla", head_dim=16).float().cuda().eval()(x).logits
    assert rel_rms_error(fla, ref) < 1e-3


def test_fla_backend_refuses_the_bounded_gate():
    with pytest.raises(ValueError, match="supports gate_form='softplus' only"):
        _model(kda_implementation="fla", gate_form="bounded")(_tokens())


def test_activation_checkpointing_counts_each_token_once():
    """Rerunning blocks during backward (non-reentrant checkpointing) leaves the MoE load as one forward's."""
    from torch.utils.checkpoint import checkpoint

    model = _model().train()
    x, y = _tokens(), _tokens(seed=2)
    model(x, y).loss.backward()
    expected = [moe.step_load.clone() for _, moe in model.moe_layers()]
    model.on_step_end(applied=False)
    for layer in model.layers:
        plain = layer.forward
        layer.forward = lambda h, r=None, plain=plain: checkpoint(plain, h, r, use_reentrant=False)
    model(x, y).loss.backward()
    assert all(torch.equal(moe.step_load, e) for (_, moe), e in zip(model.moe_layers(), expected))
    assert all(e.sum() == 2 * 21 * 2 for e in expected)  # B * T tokens, top_k = 2


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint_blocks"])
def test_only_training_forwards_count_moe_load(checkpointed):
    """Eval and no-grad forwards (evaluation, a probe) add no MoE load, so they neither show in the
    diagnostics nor move the router bias; not even the stats a checkpointed backward's rerun left."""
    model = _model(bias_update_rate=0.1).train()
    model.checkpoint_blocks = checkpointed
    x, y = _tokens(), _tokens(seed=2)
    model(x, y).loss.backward()  # with checkpoint_blocks, the backward reruns every block's forward
    model.on_step_end(applied=True)
    biases = [moe.router.e_score_correction_bias.clone() for _, moe in model.moe_layers()]
    with torch.no_grad():
        model.eval()(x, y)
        model.train()(x, y)
    assert all(moe.step_load.sum() == 0 and moe.step_entropy[1] == 0 for _, moe in model.moe_layers())
    model.on_step_end(applied=True)
    assert all(torch.equal(b, moe.router.e_score_correction_bias) for b, (_, moe) in zip(biases, model.moe_layers()))


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence length 21 > model.max_seq_len=16"):
        _model(max_seq_len=16)(_tokens())
