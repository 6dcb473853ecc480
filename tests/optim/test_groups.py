from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from kimik3.config.schema import ModelConfig, TrainConfig
from kimik3.models import BUILDERS, build_model
from kimik3.optim import build_optimizer
from kimik3.optim.groups import block_split, match_rule

# (parameter name in FakeKimi, group under optimizer=muon)
EXPECTED_MUON_RUN = {
    "embed.weight": "adamw",
    "lm_head.weight": "adamw",
    "norm.weight": "adamw_no_decay",
    "layers.0.attn_norm.weight": "adamw_no_decay",
    "layers.0.attn.q_proj.weight": "muon",
    "layers.0.attn.q_conv1d.weight": "adamw",
    "layers.0.attn.A_log": "adamw_no_decay",
    "layers.0.attn.dt_bias": "adamw_no_decay",
    "layers.0.attn.o_norm.weight": "adamw_no_decay",
    "layers.0.attn.b_proj.weight": "muon",
    "layers.0.ffn.router.weight": "adamw",
    "layers.0.ffn.experts.gate_up_proj": "muon",
    "layers.0.ffn.shared.weight": "muon",
    "layers.0.ffn.shared.bias": "adamw_no_decay",
    "layers.1.attn.kv_a_norm.weight": "adamw_no_decay",
    "layers.1.attn.kv_b_proj.weight": "muon",
}


def group_of(opt) -> dict[int, list[str]]:
    return {id(p): [g["name"] for g in opt.param_groups if any(p is q for q in g["params"])]
            for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_every_trainable_parameter_is_in_exactly_one_group(fake_kimi, optimizer):
    fake_kimi.layers[0].attn.o_norm.weight.requires_grad_(False)
    opt, summary = build_optimizer(fake_kimi, TrainConfig(optimizer=optimizer))
    owners = group_of(opt)
    for name, p in fake_kimi.named_parameters():
        assert len(owners.get(id(p), [])) == (1 if p.requires_grad else 0), name
    trainable = [p for p in fake_kimi.parameters() if p.requires_grad]
    assert sum(s["count"] for s in summary) == len(trainable)
    assert sum(s["numel"] for s in summary) == sum(p.numel() for p in trainable)


def test_groups_follow_the_rule_table(fake_kimi):
    opt, summary = build_optimizer(fake_kimi, TrainConfig(optimizer="muon", weight_decay=0.1))
    named = dict(fake_kimi.named_parameters())
    owners = group_of(opt)
    for name, group in EXPECTED_MUON_RUN.items():
        assert owners[id(named[name])] == [group], name
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["muon"]["kind"] == "muon" and by_name["muon"]["weight_decay"] == 0.1
    assert by_name["adamw"]["weight_decay"] == 0.1
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    assert all(g["base_lr"] == g["lr"] == 3e-3 for g in opt.param_groups)
    assert {s["name"]: s["optimizer"] for s in summary} == {
        "muon": "muon", "adamw": "adamw", "adamw_no_decay": "adamw"}
    assert summary[0]["rules"] == {"matrix": 16}


def test_adamw_run_has_no_muon_group_and_keeps_no_decay_rules(fake_kimi):
    muon_opt, _ = build_optimizer(fake_kimi, TrainConfig(optimizer="muon"))
    adamw_opt, summary = build_optimizer(fake_kimi, TrainConfig(optimizer="adamw"))
    assert [g["kind"] for g in adamw_opt.param_groups] == ["adamw", "adamw"]
    no_decay = lambda opt: {id(p) for g in opt.param_groups if g["name"] == "adamw_no_decay" for p in g["params"]}  # noqa: E731
    assert no_decay(adamw_opt) == no_decay(muon_opt)


def test_a_4d_parameter_matches_no_rule():
    with pytest.raises(ValueError, match="matches no optimizer rule"):
        match_rule("layers.0.patch.weight", 4)


def test_bad_optimizer_name_is_rejected(fake_kimi):
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        build_optimizer(fake_kimi, TrainConfig(optimizer="sgd"))


def test_block_splits_for_heads_and_fused_gate_up(fake_kimi):
    assert block_split(fake_kimi, "layers.1.attn.q_proj.weight", True) == (0, 2)
    assert block_split(fake_kimi, "layers.1.attn.kv_b_proj.weight", True) == (0, 2)
    assert block_split(fake_kimi, "layers.1.attn.o_proj.weight", True) == (1, 2)
    assert block_split(fake_kimi, "layers.1.attn.kv_a_proj.weight", True) is None
    assert block_split(fake_kimi, "layers.0.attn.v_proj.weight", True) == (0, 2)
    assert block_split(fake_kimi, "layers.0.attn.f_proj.weight", True) is None
    assert block_split(fake_kimi, "layers.1.attn.q_proj.weight", False) is None
    assert block_split(fake_kimi, "layers.0.ffn.experts.gate_up_proj", False) == (0, 2)
    for per_head, count in ((True, 9), (False, 2)):  # KDA q,k,v,o + MLA q,kv_b,o + 2 gate_up
        opt, _ = build_optimizer(fake_kimi, TrainConfig(optimizer="muon", muon_per_head=per_head))
        muon = next(g for g in opt.param_groups if g["kind"] == "muon")
        assert sum(s is not None for s in muon["block_splits"]) == count


def test_per_head_needs_a_head_count():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.q_proj = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="neither an MLA max_logits buffer nor an int num_heads"):
        build_optimizer(model, TrainConfig(optimizer="muon", muon_per_head=True))
    torch.nn.init.zeros_(model.attn.q_proj.weight)
    opt, _ = build_optimizer(model, TrainConfig(optimizer="muon"))
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw_no_decay"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(muon_ns_steps=0), "train.muon_ns_steps=0"),
        (dict(muon_momentum=1.0), "train.muon_momentum=1.0"),
        (dict(muon_rms_scale=0.0), "train.muon_rms_scale=0.0"),
        (dict(qk_clip_threshold=-1.0), "train.qk_clip_threshold=-1.0"),
        (dict(schedule="wsd", warmup_steps=190), "overlaps the WSD decay"),
    ],
)
def test_bad_optimizer_fields_fail_before_building(fake_kimi, kw, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(fake_kimi, TrainConfig(optimizer="muon", **kw))


MODEL_PRESETS = {"smoke_test_lm": "smoke", "kimi_k3": "kimi_k3_tiny"}
"""A conf/model preset per architecture in models.BUILDERS."""


@pytest.mark.parametrize("arch", sorted(MODEL_PRESETS))
def test_every_model_gives_its_output_head_to_adamw(arch):
    """Any weight with a vocab-sized dim (embedding, output head) is AdamW under a Muon run; the
    vocab (97) is prime so no hidden matrix has it by chance."""
    assert set(MODEL_PRESETS) == set(BUILDERS), "add the new architecture's preset to MODEL_PRESETS"
    preset = OmegaConf.load(Path(__file__).parents[2] / "conf" / "model" / f"{MODEL_PRESETS[arch]}.yaml")
    cfg = ModelConfig(**{k: v for k, v in OmegaConf.to_container(preset).items() if k != "defaults"})
    assert cfg.arch == arch
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=97)
    opt, _ = build_optimizer(model, TrainConfig(optimizer="muon"))
    group = {id(p): g["name"] for g in opt.param_groups for p in g["params"]}
    vocab_sized = {n: group[id(p)] for n, p in model.named_parameters() if 97 in p.shape}
    assert "lm_head.weight" in vocab_sized or cfg.tie_embeddings
    assert vocab_sized and set(vocab_sized.values()) == {"adamw"}, vocab_sized
