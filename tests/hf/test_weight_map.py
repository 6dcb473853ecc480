"""The weight table covers every KimiK3 tensor exactly once, and each rule is an exact bijection."""

import re

import pytest
import torch

pytest.importorskip("safetensors", reason="needs pip install 'kimik3[hf]'")  # kimik3.hf imports it

from kimik3.config.schema import ModelConfig  # noqa: E402
from kimik3.hf.weight_map import Rule, canonical_hf_name, check_complete, rules_for  # noqa: E402
from kimik3.models import build_model  # noqa: E402

SHAPES = {
    "hybrid": dict(mla_every=2),
    "q_lora": dict(mla_every=2, q_lora_rank=12),
    "kda_only": dict(mla_every=0, n_group=2, topk_group=1),
    "mla_only_dense": dict(mla_every=1, num_experts=0),
    "all_moe": dict(mla_every=3, first_k_dense=0),
}


def _cfg(**over) -> ModelConfig:
    base = dict(hidden_size=32, num_layers=4, num_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, num_experts=4, top_k=2,
                moe_intermediate_size=16)
    return ModelConfig(**{**base, **over})


@pytest.mark.parametrize("name", list(SHAPES))
def test_table_covers_every_tensor_once(name):
    cfg = _cfg(**SHAPES[name])
    with torch.device("meta"):
        state = build_model(cfg, 64).state_dict()
    rules = rules_for(cfg)
    check_complete(rules, state)
    hf_names = [n for r in rules for n in r.hf_names()]
    assert len(hf_names) == len(set(hf_names))  # no HF tensor feeds two KimiK3 tensors
    assert len(rules) == len(state)


def test_a_missing_or_extra_rule_fails():
    cfg = _cfg(mla_every=2)
    with torch.device("meta"):
        names = list(build_model(cfg, 64).state_dict())
    rules = rules_for(cfg)
    bias = next(r for r in rules if r.ours.endswith("e_score_correction_bias"))
    with pytest.raises(ValueError, match="without an HF mapping: \\['layers.1.ffn.router.e_score_correction_bias'\\]"):
        check_complete([r for r in rules if r is not bias], names)
    with pytest.raises(ValueError, match="KimiK3 does not have: \\['layers.9.attn.A_log'\\]"):
        check_complete(rules + [Rule("layers.9.attn.A_log", ("x",))], names)


@pytest.mark.parametrize("rule,ours_shape,hf_shapes", [
    (Rule("e.gate_up", ("x.{e}.w1", "x.{e}.w3"), op="experts", num_experts=3), (3, 10, 4), [(5, 4)] * 6),
    (Rule("e.down", ("x.{e}.w2",), op="experts", num_experts=3), (3, 4, 5), [(4, 5)] * 3),
    (Rule("conv", ("q", "k", "v")), (12, 1, 4), [(4, 1, 4)] * 3),
    (Rule("A_log", ("A",), hf_shape=(1, 1, 3, 1)), (3,), [(1, 1, 3, 1)]),
])
def test_rules_split_and_join_exactly(rule, ours_shape, hf_shapes):
    ours = torch.randn(ours_shape)
    pieces = rule.to_hf(ours)
    assert [n for n, _ in pieces] == rule.hf_names()
    assert [tuple(t.shape) for _, t in pieces] == hf_shapes
    assert torch.equal(rule.to_ours(dict(pieces), ours_shape), ours)


def test_expert_layout_is_gate_rows_then_up_rows():
    rule = Rule("e.gate_up", ("x.{e}.w1", "x.{e}.w3"), op="experts", num_experts=2)
    parts = {f"x.{e}.w{j}": torch.full((2, 3), 10.0 * e + j) for e in range(2) for j in (1, 3)}
    fused = rule.to_ours(parts, (2, 4, 3))
    assert fused[1, :2].eq(11).all() and fused[1, 2:].eq(13).all()


def test_shape_mismatch_names_the_tensor():
    rule = Rule("layers.0.attn.q_proj.weight", ("model.layers.0.self_attn.q_proj.weight",))
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.weight"):
        rule.to_ours({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 4)}, (4, 4))


@pytest.mark.parametrize("rule,hf_name,hf_shape,ours_shape", [
    (Rule("g_a", ("x.g_a",)), "x.g_a", (8, 4), (4, 8)),  # transposed: same element count
    (Rule("e.gate_up", ("x.{e}.w1", "x.{e}.w3"), op="experts", num_experts=2), "x.1.w3", (3, 2), (2, 4, 3)),
    (Rule("conv", ("q", "k", "v")), "k", (2, 1, 8), (12, 1, 4)),
])
def test_a_part_of_the_wrong_shape_is_refused_naming_it(rule, hf_name, hf_shape, ours_shape):
    parts = dict(rule.to_hf(torch.randn(ours_shape)))
    parts[hf_name] = torch.randn(hf_shape)
    with pytest.raises(ValueError, match=rf"^{hf_name} has shape {re.escape(str(hf_shape))} in the checkpoint"):
        rule.to_ours(parts, ours_shape)


def test_size_one_dims_of_a_part_are_accepted():
    rule = Rule("A_log", ("A",), hf_shape=(1, 1, 3, 1))
    a = torch.randn(3)
    assert torch.equal(rule.to_ours({"A": a}, (3,)), a)  # stored as [H] instead of [1, 1, H, 1]
    conv = Rule("conv", ("q", "k", "v"))
    parts = {n: torch.randn(4, 3) for n in "qkv"}  # [D, K] instead of [D, 1, K]
    assert torch.equal(conv.to_ours(parts, (12, 1, 3)), torch.cat(list(parts.values())).reshape(12, 1, 3))


def test_dense_ffn_saved_under_block_sparse_moe_is_read():
    assert canonical_hf_name("model.layers.0.block_sparse_moe.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert canonical_hf_name("model.layers.1.block_sparse_moe.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
