"""Chunkwise KDA in plain PyTorch (WY/UT transform): exact, autograd-differentiable, any device.

Shapes: B batch, T time, H heads, K key dim, V value dim, N chunks, C chunk size, S sub-chunk size.

Within a chunk of C tokens starting from state S0 [K, V], let gc = cumsum(g) (log decay since the
chunk start, per key channel). Unrolling the recurrence of naive.py gives (Kimi Linear,
arXiv:2510.26692, sec. 3; Yang et al., "Parallelizing Linear Transformers with the Delta Rule",
for the WY/UT form):

    A_kk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(gc_i[c] - gc_j[c])            j < i
    A_qk[i, j] = scale  * sum_c q_i[c] k_j[c] exp(gc_i[c] - gc_j[c])            j <= i
    Tm = (I + A_kk)^-1                                   (UT transform: unit lower triangular)
    u  = Tm (beta * v),   w = Tm (beta * k * exp(gc))    (WY representation)
    delta = u - w S0                                     (the delta-rule corrected values)
    o  = scale * (q * exp(gc)) S0 + A_qk delta
    S_C = exp(gc_C) * S0 + (k * exp(gc_C - gc))^T delta

Only a loop over chunks remains (N = T / C steps). The pairwise decay exp(gc_i - gc_j) must never be
formed as exp(gc_i) * exp(-gc_j): with the unbounded softplus gate exp(-gc_j) overflows fp32. So the
score matrices are built from sub-chunks of S tokens: inside a diagonal sub-chunk block the decay is
formed per pair ([S, S, K], exponent <= 0); for an off-diagonal block (query sub-chunk a, key
sub-chunk b < a) the decay factors through the first position r of sub-chunk a,
exp(gc_i - gc_r) * exp(gc_r - gc_j), and both exponents are <= 0. Everything is exact; only
underflow (to a true value that small) can occur.

A final partial chunk is zero-padded (k = v = beta = g = 0 leave the state untouched), so any T works.
Packed sequences (cu_seqlens) are unpacked into a zero-padded batch, run, and repacked.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.ops.kda.checks import check_cu_seqlens_values

_SUB_CHUNK = 16
"""Largest sub-chunk for the intra-chunk scores (it bounds the [S, S, K] per-pair decay tensor)."""


def chunk_kda(
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
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """KDA by chunks; same contract as `naive_recurrent_kda` plus `chunk_size`.

    Args:
        q, k: [B, T, H, K] queries and keys (already L2-normalised by the caller).
        v: [B, T, H, V] values.
        g: [B, T, H, K] per-channel decay in log space (<= 0).
        beta: [B, T, H] delta-rule step size in (0, 1).
        scale: query scale; default K ** -0.5.
        initial_state: [N, H, K, V] (N = B, or the number of packed sequences); zeros if None.
        output_final_state: also return the state after the last token.
        cu_seqlens: [N + 1] cumulative lengths of packed sequences (requires B == 1).
        chunk_size: tokens per chunk (any positive int; T need not be a multiple of it).

    Returns:
        o: [B, T, H, V] in v's dtype, and the final state [N, H, K, V] (fp32, or fp64 for fp64
        inputs) or None. Computation runs in fp32 (fp64 when the inputs are fp64).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive integer")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0:
        return no_tokens(q, v, initial_state, output_final_state, cu_seqlens, v.dtype)
    if cu_seqlens is not None:
        return _packed_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    o, state = _batched_chunk_kda(q, k, v, g, beta, scale, initial_state, chunk_size)
    return o, (state if output_final_state else None)


def no_tokens(q: Tensor, v: Tensor, initial_state: Optional[Tensor], output_final_state: bool,
              cu_seqlens: Optional[Tensor], out_dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """T = 0 (as naive gives it): an empty o in out_dtype, and each sequence's initial state (zeros if
    None) as its final state. Chunking no tokens would view 0 elements with a -1 dim, which torch refuses
    (here and in the Triton path, function.triton_kda, which returns it too)."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is not None:  # a sync, but only for this corner: [0, 0, ...] is the one valid table
        check_cu_seqlens_values(cu_seqlens.tolist(), 0)
    o = v.new_zeros(B, 0, H, V, dtype=out_dtype)
    if not output_final_state:
        return o, None
    dtype = torch.promote_types(q.dtype, torch.float32)
    state = q.new_zeros(N, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).clone()
    return o, state


def _batched_chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Optional[Tensor], chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Chunkwise KDA over a dense batch; returns o [B, T, H, V] and the final state [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q_c, k_c, v_c, g_c = (to_chunks(x) for x in (q, k, v, g))
    beta_c = to_chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    gc = g_c.cumsum(-2)  # [B, H, N, C, K] log decay from the chunk start, inclusive
    sub = math.gcd(C, _SUB_CHUNK)

    P_q, P_k = _intra_chunk_scores(q_c, k_c, gc, sub)  # [B, H, N, C, C] each
    A_qk, A_kk = scale * P_q, beta_c * P_k
    eye = torch.eye(C, dtype=dtype, device=q.device)
    # UT transform: Tm = (I + A_kk)^-1, unit lower triangular (A_kk is strictly lower).
    Tm = torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk), upper=False, unitriangular=True)
    u = Tm @ (beta_c * v_c)  # [B, H, N, C, V]
    w = Tm @ (beta_c * k_c * gc.exp())  # [B, H, N, C, K]
    q_decayed = scale * q_c * gc.exp()  # [B, H, N, C, K]
    g_last = gc[..., -1:, :]  # [B, H, N, 1, K]
    k_to_end = k_c * (g_last - gc).exp()  # [B, H, N, C, K] key decayed to the chunk end

    if initial_state is None:
        S = q_c.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dtype)
    outputs = []
    for n in range(N):
        delta = u[:, :, n] - w[:, :, n] @ S  # [B, H, C, V]
        outputs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ delta)
        S = g_last[:, :, n].exp().transpose(-1, -2) * S + k_to_end[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outputs, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(v.dtype), S


def _intra_chunk_scores(q: Tensor, k: Tensor, gc: Tensor, sub: int) -> tuple[Tensor, Tensor]:
    """Decayed scores P_x[i, j] = sum_c x_i[c] k_j[c] exp(gc_i[c] - gc_j[c]) for x = q (j <= i) and
    x = k (j < i), 0 elsewhere.

    q, k, gc: [..., C, K]; returns (P_q, P_k), each [..., C, C]. Built by sub-chunks of `sub` tokens
    so that every exponent is <= 0 (see the module docstring); the decayed keys are shared by both.
    """
    *lead, C, K = q.shape
    n = C // sub
    qs, ks, gs = (t.reshape(*lead, n, sub, K) for t in (q, k, gc))
    device = q.device

    # Diagonal blocks: keys decayed to each query position, per pair, masked before exp so the upper
    # triangle (positive exponents) never overflows.
    causal = torch.ones(sub, sub, dtype=torch.bool, device=device).tril()
    rel = (gs.unsqueeze(-2) - gs.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf"))  # [.., n, i, j, K]
    k_decayed = ks.unsqueeze(-3) * rel.exp()  # [.., n, i, j, K]
    diag_q = torch.einsum("...ik,...ijk->...ij", qs, k_decayed)  # [.., n, S, S]
    diag_k = torch.einsum("...ik,...ijk->...ij", ks, k_decayed).tril(-1)
    if n == 1:
        return diag_q.reshape(*lead, C, C), diag_k.reshape(*lead, C, C)

    # Off-diagonal blocks (a > b): decay through r = the first position of query sub-chunk a.
    ref = gs[..., :, :1, :]  # [.., n, 1, K]
    to_ref = (gs - ref).exp()  # [.., a, S, K]
    earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # b < a
    ref_minus_g = (ref.unsqueeze(-3) - gs.unsqueeze(-4)).masked_fill(~earlier[:, :, None, None], float("-inf"))
    k_from_ref = ks.unsqueeze(-4) * ref_minus_g.exp()  # [.., a, b, S, K]
    block_eye = torch.eye(n, dtype=q.dtype, device=device)[:, None, :, None]  # [a, 1, b, 1]

    def assemble(xs: Tensor, diag: Tensor) -> Tensor:
        off = torch.einsum("...aik,...abjk->...aibj", xs * to_ref, k_from_ref)  # [.., a, S, b, S]
        return (off + diag.unsqueeze(-2) * block_eye).reshape(*lead, C, C)

    return assemble(qs, diag_q), assemble(ks, diag_k)


def _packed_chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Optional[Tensor], output_final_state: bool, cu_seqlens: Tensor, chunk_size: int,
) -> tuple[Tensor, Optional[Tensor]]:
    """Packed sequences: unpack to a zero-padded batch [N, L, ...], run, repack to [1, T, ...]."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={q.shape[0]}")
    bounds = cu_seqlens.tolist()
    check_cu_seqlens_values(bounds, q.shape[1])
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    L = max(lengths)

    def unpack(x: Tensor) -> Tensor:  # [1, T, ...] -> [N, L, ...], zeros past each sequence's end
        rows = [F.pad(x[0, s : s + n], (0, 0) * (x.ndim - 2) + (0, L - n)) for s, n in zip(bounds, lengths)]
        return torch.stack(rows)

    o, state = _batched_chunk_kda(
        unpack(q), unpack(k), unpack(v), unpack(g), unpack(beta), scale, initial_state, chunk_size
    )
    o = torch.cat([o[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)  # [1, T, H, V]
    return o, (state if output_final_state else None)
