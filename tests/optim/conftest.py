"""Small fake modules with the model contract's names and MLA layout, for optimizer tests.

They stand in for KimiK3 (tests against the real model live beside them and skip until it exists):
the same parameter names (embed, lm_head, norm, conv, router, A_log, dt_bias, 3-D experts) and an
MLA with q_proj / q_a_proj+q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj, o_proj and `max_logits`.
Legend: B batch, T time, C hidden, H heads, E experts.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch import Tensor, nn


class FakeMLA(nn.Module):
    """MLA attention in the contract layout, without RoPE rotation (it does not affect QK-Clip's algebra)."""

    def __init__(self, hidden: int, heads: int, nope: int, rope: int, v: int, kv_lora: int,
                 q_lora: Optional[int] = None) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v = heads, nope, rope, v
        q_out = heads * (nope + rope)
        if q_lora is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora, bias=False)
            self.q_a_norm = nn.RMSNorm(q_lora)
            self.q_b_proj = nn.Linear(q_lora, q_out, bias=False)
        self.kv_a_proj = nn.Linear(hidden, kv_lora + rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(kv_lora)
        self.kv_b_proj = nn.Linear(kv_lora, heads * (nope + v), bias=False)
        self.o_proj = nn.Linear(heads * v, hidden, bias=False)
        self.register_buffer("max_logits", torch.full((heads,), -math.inf), persistent=False)
        self.track_max_logits = True

    def reset_max_logits(self) -> None:
        self.max_logits.fill_(-math.inf)

    def forward(self, x: Tensor) -> Tensor:  # x [B, T, C]
        B, T, _ = x.shape
        H, nope, rope = self.heads, self.nope, self.rope
        q_in = x if hasattr(self, "q_proj") else self.q_a_norm(self.q_a_proj(x))
        q = (self.q_proj if hasattr(self, "q_proj") else self.q_b_proj)(q_in)
        q = q.view(B, T, H, nope + rope).transpose(1, 2)  # [B, H, T, nope + rope]
        latent, k_rope = self.kv_a_proj(x).split([self.kv_b_proj.in_features, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(B, T, H, nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v], dim=-1)  # [B, H, T, nope], [B, H, T, v]
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, T, rope)], dim=-1)
        logits = q @ k.transpose(-1, -2) / math.sqrt(nope + rope)  # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        if self.track_max_logits:
            seen = logits.detach().masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
            self.max_logits.copy_(torch.maximum(self.max_logits, seen.float()))
        attn = logits.masked_fill(~causal, -math.inf).softmax(-1)
        return self.o_proj((attn @ v).transpose(1, 2).reshape(B, T, H * self.v))


class FakeKDA(nn.Module):
    """KDA's parameters (no recurrence): per-head q/k/v/o projections, short convs, gate params."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = heads
        inner = heads * head_dim
        self.q_proj = nn.Linear(hidden, inner, bias=False)
        self.k_proj = nn.Linear(hidden, inner, bias=False)
        self.v_proj = nn.Linear(hidden, inner, bias=False)
        self.q_conv1d = nn.Conv1d(inner, inner, 4, groups=inner, bias=False)  # weight [inner, 1, 4]
        self.f_proj = nn.Linear(hidden, inner, bias=False)
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(inner))
        self.o_norm = nn.RMSNorm(head_dim)
        self.o_proj = nn.Linear(inner, hidden, bias=False)


class FakeMoE(nn.Module):
    """Router + 3-D expert weights [E, out, in] (gate and up fused) + a shared expert with a bias."""

    def __init__(self, hidden: int, experts: int, inter: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("router_bias", torch.zeros(experts))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.02)
        self.shared = nn.Linear(hidden, inter, bias=True)


class FakeKimi(nn.Module):
    """embed -> [KDA, MLA] blocks with norms and MoE -> norm -> lm_head (parameters only)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList()
        for mixer in (FakeKDA(hidden, heads, 16), FakeMLA(hidden, heads, 8, 4, 8, 16)):
            block = nn.Module()
            block.attn_norm, block.attn = nn.RMSNorm(hidden), mixer
            block.ffn_norm, block.ffn = nn.RMSNorm(hidden), FakeMoE(hidden, 4, 24)
            self.layers.append(block)
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


@pytest.fixture
def fake_kimi() -> FakeKimi:
    torch.manual_seed(0)
    return FakeKimi()


@pytest.fixture
def make_mla():
    """Factory: make_mla(q_lora=None) -> a FakeMLA with 4 heads (nope 8, rope 4, v 8, kv_lora 16)."""

    def make(q_lora: Optional[int] = None) -> FakeMLA:
        torch.manual_seed(0)
        return FakeMLA(hidden=32, heads=4, nope=8, rope=4, v=8, kv_lora=16, q_lora=q_lora)

    return make
