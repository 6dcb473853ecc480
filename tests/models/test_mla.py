"""MLA against a straightforward softmax attention built from the same weights; exact max logits."""

from __future__ import annotations

import math

import pytest
import torch

import kimik3.models.mla as mla_module
from kimik3.config.schema import ModelConfig
from kimik3.models.mla import MLA
from kimik3.models.rope import apply_rope

D, H, DN, DR, DV, LKV = 32, 3, 8, 4, 6, 16


def _cfg(**overrides) -> ModelConfig:
    base = dict(hidden_size=D, num_heads=H, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
                kv_lora_rank=LKV)
    return ModelConfig(**{**base, **overrides})


def _mla(**overrides) -> MLA:
    torch.manual_seed(0)
    m = MLA(_cfg(**overrides)).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference(m: MLA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head loops and an explicit masked softmax, written from the MLA equations.
    Returns the output [B, T, D] and the unmasked logits [B, H, T, T]."""
    B, T, _ = x.shape
    if hasattr(m, "q_proj"):
        q_all = x @ m.q_proj.weight.T
    else:
        q_all = _rms(x @ m.q_a_proj.weight.T, m.q_a_norm.weight) @ m.q_b_proj.weight.T
    kv_a = x @ m.kv_a_proj.weight.T
    latent, k_rope = _rms(kv_a[..., :LKV], m.kv_a_norm.weight), kv_a[..., LKV:]
    if m.use_rope:
        k_rope = apply_rope(k_rope, m.rope_theta)
    kv_b = latent @ m.kv_b_proj.weight.T
    heads, logits_all = [], []
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(H):
        q_h = q_all[..., h * (DN + DR) : (h + 1) * (DN + DR)]  # nope rows first, then rope rows
        if m.use_rope:
            q_h = torch.cat([q_h[..., :DN], apply_rope(q_h[..., DN:], m.rope_theta)], dim=-1)
        k_nope = kv_b[..., h * (DN + DV) : h * (DN + DV) + DN]
        v_h = kv_b[..., h * (DN + DV) + DN : (h + 1) * (DN + DV)]
        k_h = torch.cat([k_nope, k_rope], dim=-1)
        logits = (q_h @ k_h.transpose(-1, -2)) / math.sqrt(DN + DR)
        logits_all.append(logits)
        heads.append(torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1) @ v_h)
    o = torch.cat(heads, dim=-1)
    if m.g_proj is not None:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T)
    return o @ m.o_proj.weight.T, torch.stack(logits_all, dim=1)


def _causal_max(logits: torch.Tensor) -> torch.Tensor:
    """Per-head max over causal pairs of [B, H, T, T] logits."""
    T = logits.shape[-1]
    future = ~torch.ones(T, T, dtype=torch.bool).tril()
    return logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": 12}, {"mla_use_rope": True}, {"mla_output_gate": True}],
    ids=["full-q", "low-rank-q", "rope", "output-gate"],
)
def test_mla_matches_reference_softmax_attention(overrides):
    m = _mla(**overrides)
    x = torch.randn(2, 11, D, dtype=torch.float64)
    expected, _ = _reference(m, x)
    assert torch.allclose(m(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_elems", [1 << 24, 7], ids=["one-block", "many-blocks"])
def test_max_logits_are_exact_running_max(monkeypatch, block_elems):
    """max_logits equals the brute-force causal max per head, accumulates over forwards, resets."""
    monkeypatch.setattr(mla_module, "_MAX_LOGIT_BLOCK_ELEMS", block_elems)
    m = _mla()
    x1, x2 = torch.randn(2, 9, D, dtype=torch.float64), 3 * torch.randn(1, 13, D, dtype=torch.float64)
    m(x1)
    assert torch.isinf(m.max_logits).all()  # not tracked unless asked
    m.track_max_logits = True
    m(x1)
    brute1 = _causal_max(_reference(m, x1)[1])
    assert torch.allclose(m.max_logits.double(), brute1, rtol=1e-6)
    m(x2)
    brute2 = _causal_max(_reference(m, x2)[1])
    assert torch.allclose(m.max_logits.double(), torch.maximum(brute1, brute2), rtol=1e-6)
    m.end_step()
    assert torch.isinf(m.max_logits).all() and torch.allclose(m.last_max_logits.double(), torch.maximum(brute1, brute2), rtol=1e-6)


def test_max_logits_ignore_future_positions():
    """Logits with future keys do not count: here they are larger, so counting them would show."""
    m = _mla()
    m.track_max_logits = True
    x = torch.randn(1, 6, D, dtype=torch.float64)
    _, logits = _reference(m, x)
    causal = _causal_max(logits)
    assert bool((logits.amax(dim=(0, 2, 3)) > causal).any())  # the case is discriminating
    m(x)
    assert torch.allclose(m.max_logits.double(), causal, rtol=1e-6)


def test_rope_is_a_rotation_by_position_in_fp64():
    """apply_rope against complex multiplication by exp(i t theta^(-2j/R)), pairing dim j with j + R/2
    (rotate-half); fp64 in, fp64 throughout (it once rounded fp64 to fp32: 3e-7 off)."""
    R, T = 8, 7
    x = torch.randn(2, T, 3, R, dtype=torch.float64)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    z = torch.complex(x[..., : R // 2], x[..., R // 2 :]) * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    assert torch.allclose(apply_rope(x, 1e4), torch.cat([z.real, z.imag], dim=-1), rtol=0, atol=1e-12)
