"""Token-by-token KDA recurrence in fp32: the oracle every faster form is checked against.

Shapes: B batch, T time, H heads, K key dim, V value dim.

Kimi Delta Attention (Kimi Linear, arXiv:2510.26692, eq. 1), a gated delta rule whose decay is per
channel of the key dimension:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T      S_t: [K, V]
    o_t = scale * S_t^T q_t

It is written the obvious way on purpose (decay, then the delta-rule correction), so that a
reader can check it against the equation line by line.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kimik3.ops.kda.checks import check_cu_seqlens_values


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Run the KDA recurrence step by step.

    Args:
        q, k: [B, T, H, K] queries and keys (already L2-normalised by the caller).
        v: [B, T, H, V] values.
        g: [B, T, H, K] per-channel decay in log space (<= 0; exp(g) is the decay factor).
        beta: [B, T, H] delta-rule step size, already in (0, 1).
        scale: query scale; default K ** -0.5.
        initial_state: [N, H, K, V] state before the first token (N = B, or the number of
            sequences when cu_seqlens is given); zeros if None.
        output_final_state: also return the state after the last token, [N, H, K, V] fp32.
        cu_seqlens: [N + 1] int cumulative lengths of packed sequences (requires B == 1): the
            state restarts at each boundary so packed documents never see each other.

    Returns:
        o: [B, T, H, V] in q's dtype, and the final state (fp32) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got B={B}")
        cu = cu_seqlens.tolist()
        check_cu_seqlens_values(cu, T)
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 checks
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=dtype, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is not None:
            S = initial_state[n].to(dtype).clone()  # [H, K, V]
        else:
            S = q.new_zeros(H, K, V)
        for t in range(start, end):
            S = S * g[b, t].exp()[..., None]  # decay each key channel: Diag(exp(g_t)) S
            k_t, v_t, b_t = k[b, t], v[b, t], beta[b, t]  # [H, K], [H, V], [H]
            residual = v_t - torch.einsum("hk,hkv->hv", k_t, S)  # v_t - S^T k_t
            S = S + b_t[:, None, None] * k_t[..., None] * residual[:, None, :]
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(v.dtype), final_state
