"""The KDA layer (models/kda.py) against the README's equations written out from the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimik3.config.schema import ModelConfig
from kimik3.models.kda import KDAMixer

D, H, K = 24, 2, 8


def _mixer(impl: str, gate_form: str) -> KDAMixer:
    torch.manual_seed(0)
    m = KDAMixer(ModelConfig(hidden_size=D, num_heads=H, head_dim=K, kda_implementation=impl, kda_chunk_size=4,
                             gate_form=gate_form)).double()
    for name, p in m.named_parameters():
        torch.nn.init.normal_(p, std=0.5 if name in ("A_log", "dt_bias") else 0.3)
    return m


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # l2 norm, eps as fla / transformers


def _reference(m: KDAMixer, x: torch.Tensor) -> torch.Tensor:
    """Token loops, an explicit conv tap sum and the state update as one matrix product:
    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, o_t = K^-1/2 S_t^T q_t,
    out = o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))."""
    B, T, _ = x.shape
    raw = torch.cat([x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T], dim=-1)
    W = m.conv.weight.shape[-1]
    conv = torch.zeros_like(raw)
    for t in range(T):
        for j in range(W):  # tap j reads input t - (W - 1 - j): the last tap is the current token
            if t - (W - 1 - j) >= 0:
                conv[:, t] += m.conv.weight[:, 0, j] * raw[:, t - (W - 1 - j)]
    q, k, v = (c.view(B, T, H, K) for c in F.silu(conv).split(H * K, dim=-1))
    q, k = _unit(q), _unit(k)
    f = ((x @ m.f_a_proj.weight.T) @ m.f_b_proj.weight.T).view(B, T, H, K) + m.dt_bias.view(H, K)
    rate = m.A_log.exp().view(H, 1)
    g = -rate * F.softplus(f) if m.gate_form == "softplus" else m.gate_lower_bound * torch.sigmoid(rate * f)
    beta = torch.sigmoid(x @ m.b_proj.weight.T)  # [B, T, H]
    eye = torch.eye(K, dtype=x.dtype)
    o = torch.zeros(B, T, H, K, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, K, dtype=x.dtype)
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, h]
                S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ S + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = K**-0.5 * S.T @ q[b, t, h]
    gate = ((x @ m.g_a_proj.weight.T) @ m.g_b_proj.weight.T).view(B, T, H, K)
    normed = m.o_norm.weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps)
    return (normed * torch.sigmoid(gate)).reshape(B, T, H * K) @ m.o_proj.weight.T


@pytest.mark.parametrize("gate_form", ["softplus", "bounded"])
@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_kda_layer_matches_its_equations_in_fp64(impl, gate_form):
    """fp64 end to end (the gate, beta and q/k norm once ran in fp32 for fp64 inputs: 1e-7 off)."""
    m = _mixer(impl, gate_form)
    x = torch.randn(2, 11, D, dtype=torch.float64, requires_grad=True)  # chunk 4: two full chunks + 3
    out, ref = m(x), _reference(m, x)
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    grad_out = torch.randn_like(out)
    inputs = [x, *m.parameters()]
    for a, b in zip(torch.autograd.grad(out, inputs, grad_out), torch.autograd.grad(ref, inputs, grad_out)):
        assert (a - b).abs().max() <= 1e-11 * b.abs().max()
