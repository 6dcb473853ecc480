"""Parameter counts and training FLOPs per token of a KimiK3 config, from the config alone (feeds MFU).

Conventions (PaLM appendix B / nanoGPT `estimate_mfu`, extended to KDA and MoE):
- "activated" = matmul weights one token multiplies with: every nn.Linear it passes through
  (projections, router, shared experts, dense FFNs, the LM head) plus routed experts scaled by
  top_k / num_experts. Embeddings (a lookup), norms, short convs and KDA's A_log / dt_bias are not
  matmul weights. The head counts even when tied to the embedding.
- training FLOPs per token = 6 * activated                     (2 forward + 4 backward per weight)
    + sum over MLA layers of 3 * H_mla * (Dn + Dr + Dv) * T     (causal QK^T and PV: on average a
      token attends to T/2 keys; 2 FLOPs per multiply-add; x3 for forward + backward)
    + sum over KDA layers of 3 * H * (3 C K + 2 C V + 6 K V)    (chunkwise form, per token per head:
      A_kk, A_qk and w: C K each; u and A_qk delta: C V each; q S, w S and the state update:
      2 K V each; the C x C triangular solve, ~C^2/3, is left out)
  where T = seq_len, C = kda_chunk_size, K = V = head_dim.
The short conv, norms and pointwise ops are left out, as is usual for MFU.
"""

from __future__ import annotations

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import is_moe_layer, resolve_layer_types


def _kda_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, other parameters) of one KDA mixer."""
    D, H, K = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    HK = H * K
    matmul = 3 * D * HK + (D * K + K * HK) * 2 + D * H + HK * D  # q/k/v, f_a/f_b + g_a/g_b, b, o
    other = 3 * HK * cfg.conv_size + H + HK + K  # conv, A_log, dt_bias, o_norm
    return matmul, other


def _mla_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, other parameters) of one MLA mixer."""
    D = cfg.hidden_size
    H = cfg.mla_num_heads or cfg.num_heads
    dn, dr, dv, lkv, lq = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                           cfg.q_lora_rank)
    q = D * H * (dn + dr) if lq is None else D * lq + lq * H * (dn + dr)
    matmul = q + D * (lkv + dr) + lkv * H * (dn + dv) + H * dv * D
    if cfg.mla_output_gate:
        matmul += D * H * dv
    other = lkv + (0 if lq is None else lq)  # kv_a_norm, q_a_norm
    return matmul, other


def _ffn_counts(cfg: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(all matmul weights, activated matmul weights) of one layer's FFN."""
    D = cfg.hidden_size
    if not is_moe_layer(cfg, layer_idx):
        dense = 3 * D * cfg.intermediate_size
        return dense, dense
    expert = 3 * D * cfg.moe_intermediate_size
    fixed = cfg.num_experts * D + cfg.num_shared_experts * expert  # router + shared experts
    return fixed + cfg.num_experts * expert, fixed + cfg.top_k * expert


def parameter_counts(cfg: ModelConfig, vocab_size: int) -> dict[str, int]:
    """{"total", "embedding", "activated"} parameter counts (see the module docstring)."""
    D = cfg.hidden_size
    embedding = vocab_size * D
    head = vocab_size * D
    total = embedding + (0 if cfg.tie_embeddings else head) + D  # + final norm
    activated = head
    for i, kind in enumerate(resolve_layer_types(cfg)):
        mixer_matmul, mixer_other = _kda_counts(cfg) if kind == "kda" else _mla_counts(cfg)
        ffn_all, ffn_active = _ffn_counts(cfg, i)
        total += mixer_matmul + mixer_other + ffn_all + 2 * D  # + the block's two norms
        activated += mixer_matmul + ffn_active
    return {"total": total, "embedding": embedding, "activated": activated}


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length seq_len (module docstring)."""
    flops = 6.0 * parameter_counts(cfg, vocab_size)["activated"]
    C, K = cfg.kda_chunk_size, cfg.head_dim
    H_mla = cfg.mla_num_heads or cfg.num_heads
    for kind in resolve_layer_types(cfg):
        if kind == "mla":
            flops += 3.0 * H_mla * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * seq_len
        else:
            flops += 3.0 * cfg.num_heads * (3 * C * K + 2 * C * K + 6 * K * K)
    return flops
