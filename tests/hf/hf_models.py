"""Tiny random transformers Kimi Linear models for the interop tests (CPU, fp32).

A plain module, imported by name (`from hf_models import ...`): a test that imported from
conftest.py would get whichever conftest pytest loaded last (tests/optim has one too).

Each config stresses a different part of the mapping: hybrid with MoE, MLA only (q_lora_rank),
KDA only (MoE, n_group > 1), and a hybrid with n_group > 1 and odd sizes. Weights are transformers'
own init with std 0.1 (so every layer moves the logits) plus noise on the parts that init leaves
constant (norm weights, the router's score-correction bias), so a swapped or dropped tensor shows up.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs pip install 'kimik3[hf]'")

FULL, LINEAR = "full_attention", "linear_attention"
VOCAB = 96

HF_CONFIGS: dict[str, dict] = {
    "hybrid_moe": dict(
        hidden_size=32, num_hidden_layers=4, layer_types=[LINEAR, FULL, LINEAR, FULL],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=2, linear_head_dim=8,
        linear_conv_kernel_dim=4, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    ),
    "mla_only": dict(
        hidden_size=24, num_hidden_layers=2, layer_types=[FULL, FULL], mlp_layer_types=["dense", "dense"],
        num_attention_heads=3, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=2,
        v_head_dim=5, intermediate_size=40, linear_num_heads=2, linear_head_dim=8,
    ),
    "kda_only": dict(
        hidden_size=40, num_hidden_layers=3, layer_types=[LINEAR] * 3,
        mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=3, linear_head_dim=12,
        linear_conv_kernel_dim=3, intermediate_size=56, moe_intermediate_size=12, num_local_experts=6,
        num_experts_per_tok=2, n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.7,
        num_attention_heads=2,
    ),
    "hybrid_ngroup": dict(
        hidden_size=36, num_hidden_layers=3, layer_types=[LINEAR, LINEAR, FULL],
        mlp_layer_types=["sparse"] * 3, linear_num_heads=2, linear_head_dim=6, num_attention_heads=4,
        q_lora_rank=8, kv_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
        intermediate_size=20, moe_intermediate_size=12, num_local_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.446, rms_norm_eps=1e-6,
    ),
}


def make_hf_model(name: str, seed: int = 0):
    """A random KimiLinearForCausalLM for config `name`, in eval mode, fp32."""
    fields = HF_CONFIGS[name]
    cfg = transformers.KimiLinearConfig(
        vocab_size=VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        num_key_value_heads=fields["num_attention_heads"], **fields,
    )
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or "layernorm" in pname:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model
