"""The optimizer recipe on the real KimiK3 (conf/model/kimi_k3_tiny.yaml, shrunk where it saves time)."""

import copy
import io
import pathlib

import pytest
import torch
from omegaconf import OmegaConf

from kimik3.config.schema import ModelConfig, TrainConfig
from kimik3.models import build_model
from kimik3.models.mla import MLA
from kimik3.optim import apply_qk_clip, build_optimizer, lr_multiplier

TINY_YAML = pathlib.Path(__file__).parents[2] / "conf" / "model" / "kimi_k3_tiny.yaml"
VOCAB, B, T = 96, 2, 32


def tiny_cfg(**overrides) -> ModelConfig:
    values = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(TINY_YAML)).items() if k != "defaults"}
    return ModelConfig(**{**values, "kda_chunk_size": 16, **overrides})


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_every_kimi_k3_parameter_is_in_one_group_by_the_table():
    torch.manual_seed(0)
    model = build_model(tiny_cfg(), VOCAB)
    opt, summary = build_optimizer(model, TrainConfig(optimizer="muon", muon_per_head=True))
    owner = {id(p): g["name"] for g in opt.param_groups for p in g["params"]}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(owner) == len(list(model.parameters()))
    groups = {n: owner[id(p)] for n, p in model.named_parameters()}
    for name, group in groups.items():
        if name.endswith(("A_log", "dt_bias")) or "norm" in name:
            assert group == "adamw_no_decay", name
        elif any(key in name for key in ("embed", "lm_head", "conv", "router")):
            assert group == "adamw", name
        else:
            assert group == "muon", name
    assert groups["layers.1.ffn.experts.gate_up_proj"] == "muon"
    rules = {s["name"]: s["rules"] for s in summary}
    assert rules["adamw"] == {"embed": 1, "lm_head": 1, "conv": 3, "router": 3}


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": 48}, {"mla_use_rope": True}], ids=["q_proj", "q_lora", "rope"]
)
def test_qk_clip_on_the_real_mla(overrides):
    torch.manual_seed(0)
    mla = MLA(tiny_cfg(mla_num_heads=4, **overrides))
    x = torch.randn(B, T, 128)
    q = mla.q_b_proj if "q_lora_rank" in overrides else mla.q_proj
    with torch.no_grad():
        q.weight[48:96] *= 300.0  # head 1 of 4 (nope 32 + rope 16 rows per head)

    def max_logits():
        mla.reset_max_logits()
        mla.track_max_logits = True
        with torch.no_grad():
            mla(x)
        return mla.max_logits.clone()

    tau = 50.0
    before = max_logits()
    assert before[1] > 2 * tau and (before[[0, 2, 3]] < tau).all()
    events = apply_qk_clip(mla, tau)
    assert [e["head"] for e in events] == [1]
    after = max_logits()
    assert after[1] == pytest.approx(tau, rel=1e-3) and after[1] <= tau * (1 + 1e-3)
    torch.testing.assert_close(after[[0, 2, 3]], before[[0, 2, 3]], rtol=1e-6, atol=1e-6)
    assert apply_qk_clip(mla, None) == []


def train_steps(model, opt, batch, steps, tau):
    """The trainer's order: forward/backward, step, QK-Clip, on_step_end(applied=True)."""
    events = []
    for module in model.modules():
        if isinstance(module, MLA):
            module.track_max_logits = tau is not None
    for _ in range(steps):
        model(*batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        events += apply_qk_clip(model, tau)
        model.on_step_end(True)
    return events


def router_biases(model):
    return torch.cat([b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")])


def two_layer_model() -> torch.nn.Module:
    """KDA + MLA layers, the second with MoE: every kind of state the recipe touches, fast."""
    torch.manual_seed(0)
    return build_model(tiny_cfg(num_layers=2, layer_types=["kda", "mla"], bias_update_rate=0.01), VOCAB)


def test_router_bias_moves_only_on_applied_steps(batch):
    model = two_layer_model()
    model(*batch).loss.backward()
    start = router_biases(model).clone()
    model.on_step_end(False)
    assert torch.equal(router_biases(model), start)
    model(*batch).loss.backward()
    model.on_step_end(True)
    assert not torch.equal(router_biases(model), start)


def test_exact_resume_with_muon_qk_clip_and_router_bias(batch):
    model = two_layer_model()
    cfg = TrainConfig(optimizer="muon", lr=0.02, muon_per_head=True)
    opt, _ = build_optimizer(model, cfg)
    tau = 0.01  # below the init max logits (~0.05), so QK-Clip fires every step
    assert train_steps(model, opt, batch, 2, tau)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, saved)
    reference = copy.deepcopy(model)
    train_steps(model, opt, batch, 2, tau)

    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    reference.load_state_dict(state["model"])
    resumed_opt, _ = build_optimizer(reference, cfg)
    resumed_opt.load_state_dict(state["optim"])
    train_steps(reference, resumed_opt, batch, 2, tau)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_both_recipes_fit_a_repeated_phrase(optimizer):
    """A sign, scale or schedule slip shows here: 20 steps must take the loss from ~4.6 below 0.5.

    (Which optimizer wins on this memorisation task is not a stable property; the Muon vs AdamW
    comparison on real text is a training run, reported in the README.)"""
    gen = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, VOCAB, (16,), generator=gen)
    tokens = torch.stack([phrase.roll(i).repeat(3)[:T + 1] for i in range(4)])  # [4, T + 1]
    model = two_layer_model()
    cfg = TrainConfig(optimizer=optimizer, lr=3e-3, warmup_steps=2, max_steps=20)
    opt, _ = build_optimizer(model, cfg)
    losses = []
    for step in range(cfg.max_steps):
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr_multiplier(step, cfg)
        loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.on_step_end(True)
        losses.append(loss.item())
    assert losses[0] > 4.0 and losses[-1] < 0.5
