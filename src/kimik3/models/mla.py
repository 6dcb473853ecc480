"""MLA mixer: multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, sec. 2.1) as Kimi Linear uses it.

Shapes: B batch, T time, D hidden, H heads, Dn nope dim, Dr shared-key (rope) dim, Dv value dim,
Lkv kv_lora_rank, Lq q_lora_rank.

    q = q_proj(x) or q_b(RMSNorm(q_a(x)))                    [B, T, H, Dn + Dr]  (nope rows, then rope rows)
    c, k_r = split(kv_a_proj(x), [Lkv, Dr]);  c = RMSNorm(c)  shared latent and shared key part
    k_n, v = split(kv_b_proj(c), [Dn, Dv]) per head            [B, T, H, Dn], [B, T, H, Dv]
    k = [k_n, k_r broadcast over heads]; softmax((q k^T) / sqrt(Dn + Dr)) v, causal, via SDPA
    out = o_proj(o) (optionally o * sigmoid(g_proj(x)) first: the output gate)

k_r is NoPE unless model.mla_use_rope (Kimi Linear: NoPE). Parameter names follow the QK-Clip
contract (q_proj | q_a_proj/q_a_norm/q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj, o_proj) and map 1:1
to transformers' KimiLinearAttention (kv_a_proj_with_mqa, kv_a_layernorm, q_a_layernorm).

QK-Clip support: `max_logits` [H] (fp32, non-persistent) holds the exact max pre-softmax logit
(scale included) per head over all causal pairs seen since `reset_max_logits()`, updated in forward
while `track_max_logits` is True. SDPA never exposes its logits, so they are recomputed under
no_grad, query block by query block against the keys up to the block end, in fp32 (at most
`_MAX_LOGIT_BLOCK_ELEMS` logits live at once). Cost: one extra causal Q K^T, i.e. about
B * H * T^2 * (Dn + Dr) FLOPs per layer per forward (about a third of the attention forward).
On CUDA it is one Triton pass with the scores kept in registers (ops/max_logit.py);
the PyTorch path (other devices) runs in TF32 when TF32 matmuls are enabled globally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import Linear, RMSNorm, stacked_linear
from kimik3.models.rope import apply_rope

_LATENT_NORM_EPS = 1e-6
"""eps of q_a_norm / kv_a_norm: transformers' KimiLinear builds them with RMSNorm's default 1e-6,
not rms_norm_eps, and logits parity needs the same value."""
_MAX_LOGIT_BLOCK_ELEMS = 1 << 24
"""Logits materialised at once by the exact max-logit tracker (64 MiB in fp32)."""


class MLA(nn.Module):
    """Multi-head latent attention with exact per-head max-logit tracking (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        H = cfg.mla_num_heads or cfg.num_heads
        self.num_heads = H
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.use_rope, self.rope_theta = cfg.mla_use_rope, cfg.rope_theta
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim**-0.5
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, feeds_matmul=True)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
        self.kv_a_proj = Linear(D, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS, feeds_matmul=True)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = Linear(D, H * self.v_dim, bias=False) if cfg.mla_output_gate else None
        self.o_proj = Linear(H * self.v_dim, D, bias=False)
        self.track_max_logits = False
        self.register_buffer("max_logits", torch.full((H,), float("-inf")), persistent=False)
        self.register_buffer("last_max_logits", torch.full((H,), float("-inf")), persistent=False)

    def reset_max_logits(self) -> None:
        """Forget the logits seen so far (-inf = none seen; QK-Clip reads them once per step)."""
        self.max_logits.fill_(float("-inf"))

    def end_step(self) -> None:
        """After an optimizer attempt: keep this step's maxima (for diagnostics), then reset."""
        self.last_max_logits.copy_(self.max_logits)
        self.reset_max_logits()

    def forward(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, T, D]
        B, T, _ = x.shape
        H, Dn, Dr, Dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        # everything read from x in one GEMM: q (or its latent), the kv latent with the shared key
        # part, and the output gate
        q_proj = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        from_x = [q_proj, self.kv_a_proj] + ([self.g_proj] if self.g_proj is not None else [])
        q, kv_a, *g = stacked_linear(x, from_x).split([p.out_features for p in from_x], dim=-1)
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_norm(q))
        q = q.view(B, T, H, Dn + Dr)
        c, k_rope = kv_a.split([self.kv_lora_rank, Dr], dim=-1)  # [B, T, Lkv], [B, T, Dr]
        k_nope, v = self.kv_b_proj(self.kv_a_norm(c)).view(B, T, H, Dn + Dv).split([Dn, Dv], dim=-1)
        if self.use_rope:
            q = torch.cat([q[..., :Dn], apply_rope(q[..., Dn:], self.rope_theta)], dim=-1)
            k_rope = apply_rope(k_rope, self.rope_theta)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, T, H, Dr)], dim=-1)  # [B, T, H, Dn + Dr]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, *]
        if self.track_max_logits:
            with torch.profiler.record_function("kimik3::max_logit"):  # its own line in the step profile
                self._update_max_logits(q, k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, H, T, Dv]
        o = o.transpose(1, 2).reshape(B, T, H * Dv)
        if g:
            o = o * torch.sigmoid(g[0])
        return self.o_proj(o)

    @torch.no_grad()
    def _update_max_logits(self, q: Tensor, k: Tensor) -> None:
        """max_logits = max(max_logits, exact causal max of scale * q k^T per head); q, k: [B, H, T, Dqk].

        CUDA: one Triton pass that keeps the scores in registers (ops/max_logit.py); elsewhere the
        blocked fp32 matmul below, its reference."""
        if q.is_cuda and q.shape[-1] % 16 == 0:
            from kimik3.ops.max_logit import causal_max_logits  # imports triton: CUDA only

            torch.maximum(self.max_logits, causal_max_logits(q, k, self.scale), out=self.max_logits)
            return
        B, H, T, _ = q.shape
        rows = max(1, _MAX_LOGIT_BLOCK_ELEMS // (B * H * T))
        qf, kf = q.float(), k.float()
        pos = torch.arange(T, device=q.device)
        for start in range(0, T, rows):
            end = min(T, start + rows)
            logits = (qf[:, :, start:end] @ kf[:, :, :end].transpose(-1, -2)) * self.scale  # [B, H, r, end]
            future = pos[None, :end] > pos[start:end, None]  # [r, end]
            block_max = logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))  # [H]
            torch.maximum(self.max_logits, block_max, out=self.max_logits)
