"""Triton KDA forward kernels: the per-chunk prologue + intra-chunk stage, and the state recurrence.

Two launches make the forward (the backward reruns both, see triton_bwd.py):

1. `chunk_intra_fwd_kernel`, one program per (chunk, head), all chunks in parallel: loads raw
   q, k, v, f, b, fuses the prologue (L2 norm, gate, cumulative decay, sigmoid beta), builds the
   scores A_kk / A_qk (triton_intra.py), inverts I + A_kk (UT transform) and writes the WY factors
   w = M (beta k e^G), u~ = M (beta v), plus the decayed q and k the recurrence needs (and a
   scratch copy of normalised k, q and of G for the sub-chunk loops here and in the backward;
   band_ptr is per-program scratch for the diagonal sub-chunk blocks, BAND_SIZE [C, BC] tiles).
2. `chunk_state_kernel`, one program per (sequence, head, V block), a loop over the sequence's
   chunks carrying the fp32 state S [K, BV]:  u = u~ - w S;  o = qg S + A_qk u;
   S <- e^{G_last} * S + kd^T u. It can also store each chunk's start state (for the backward).

Shapes: C chunk (64), K key dim, V value dim, H heads, tokens packed as [Ttot, H, X].
Chunk tables: chunk_bos/chunk_eos [NT] token ranges; seq_chunks [N + 1] chunk index ranges.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_intra import pair_scores, unit_lower_inverse
from kimik3.ops.kda.triton_prologue import gate_fwd, load_rows, load_vec, row_rstd, store_rows


@triton.jit
def chunk_intra_fwd_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, chunk_bos_ptr, chunk_eos_ptr,
    w_ptr, ut_ptr, qg_ptr, kd_ptr, aqk_ptr, m_ptr, gl_ptr, kn_ptr, qn_ptr, G_ptr, band_ptr,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    LOG2NB: tl.constexpr, FORM: tl.constexpr, SCORES: tl.constexpr, DT: tl.constexpr,
    BAND_SIZE: tl.constexpr,
):
    """One (chunk, head): prologue, scores, UT inverse, WY factors (see module docstring).

    SCORES: the forward computes A_qk and the inverse M and stores both (the backward keeps them);
    the backward's rerun (SCORES=False) loads M instead and only redoes the cheap per-token parts:
    the scratch copies (normalised q too), qg, kd, gl, w and u~. Its results equal the forward's.
    K is walked in BK-wide column blocks (the row norms first, over all of K) so that only
    [C, BK] tiles are live; the scores accumulate over the blocks.
    """
    ic = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = C // BC
    bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
    n_rows = (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)
    rows = tl.arange(0, C)
    valid = rows < n_rows
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    beta = tl.where(valid, tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C)), 0.0)
    q_rstd, k_rstd = row_rstd(q_ptr, k_ptr, bos, n_rows, h, H, K, C, BK)
    band = band_ptr + (ic * H + h).to(tl.int64) * BAND_SIZE * C * BC

    p_kk = tl.zeros((C, C), dtype=tl.float32)
    p_qk = tl.zeros((C, C), dtype=tl.float32)
    for kb in range(0, K // BK):
        c0 = kb * BK
        qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
        kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
        f = load_rows(f_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h * K + c0 + tl.arange(0, BK)).to(tl.float32)
        G = tl.cumsum(tl.where(valid[:, None], gate_fwd(f, a_log, dt_bias, FORM, lower_bound), 0.0), 0)
        # scratch copies the diagonal sub-chunk loop reads back row-shifted (and the backward reuses)
        store_rows(kn_ptr, kn, bos, n_rows, h, H, K, C, BK, c0)
        store_rows(G_ptr, G, bos, n_rows, h, H, K, C, BK, c0)
        if SCORES:
            tl.debug_barrier()  # make this program's scratch rows visible to all its threads
            pk, pq = pair_scores(kn, qn, G, kn_ptr, G_ptr, band, bos, n_rows, h, c0, H, K, BK, C, BC, NB, DT)
            p_kk += pk
            p_qk += pq
        else:  # the backward's sub-chunk loops read normalised q back too
            store_rows(qn_ptr, qn, bos, n_rows, h, H, K, C, BK, c0)
        eg = tl.exp(G)
        g_last = tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), 0)  # pad rows repeat the last valid G
        store_rows(qg_ptr, scale * qn * eg, bos, n_rows, h, H, K, C, BK, c0)
        store_rows(kd_ptr, kn * tl.exp(g_last[None, :] - G), bos, n_rows, h, H, K, C, BK, c0)
        tl.store(gl_ptr + (ic * H + h).to(tl.int64) * K + c0 + tl.arange(0, BK), tl.exp(g_last))

    if SCORES:
        a_kk = tl.where(rows[:, None] > rows[None, :], beta[:, None] * p_kk, 0.0)
        store_rows(aqk_ptr, scale * p_qk, bos, n_rows, h, H, C, C, C, 0)
        m_op = unit_lower_inverse(a_kk, C, BC, LOG2NB).to(DT)
        store_rows(m_ptr, m_op, bos, n_rows, h, H, C, C, C, 0)
    else:
        tl.debug_barrier()  # the WY loops below read this program's scratch rows back
        m_op = load_rows(m_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
    for kb in range(0, K // BK):
        c0 = kb * BK
        kn = load_rows(kn_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32)
        G = load_rows(G_ptr, bos, n_rows, h, H, K, C, BK, c0)
        w = tl.dot(m_op, (beta[:, None] * kn * tl.exp(G)).to(DT))
        store_rows(w_ptr, w, bos, n_rows, h, H, K, C, BK, c0)
    for vb in range(0, V // BK):
        v = load_rows(v_ptr, bos, n_rows, h, H, V, C, BK, vb * BK).to(tl.float32)
        store_rows(ut_ptr, tl.dot(m_op, (beta[:, None] * v).to(DT)), bos, n_rows, h, H, V, C, BK, vb * BK)


@triton.jit
def chunk_state_kernel(
    w_ptr, ut_ptr, qg_ptr, kd_ptr, aqk_ptr, gl_ptr, h0_ptr, o_ptr, hs_ptr, ht_ptr,
    seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_STATES: tl.constexpr, STORE_FINAL: tl.constexpr,
    DT: tl.constexpr,
):
    """One (sequence, head, V block): the chunk-to-chunk state recurrence, optionally emitting o."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    kk = tl.arange(0, K)
    vv = v0 + tl.arange(0, BV)
    state_offs = kk[:, None] * V + vv[None, :]  # [K, BV] inside one [K, V] state
    nh = (n * H + h).to(tl.int64) * K * V
    if HAS_H0:
        S = tl.load(h0_ptr + nh + state_offs).to(tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
    c_first = tl.load(seq_chunks_ptr + n)
    c_end = tl.load(seq_chunks_ptr + n + 1)
    for ic in range(c_first, c_end):
        bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
        n_rows = (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)
        if STORE_STATES:
            tl.store(hs_ptr + (ic * H + h).to(tl.int64) * K * V + state_offs, S.to(hs_ptr.dtype.element_ty))
        s_op = S.to(DT)
        w = load_rows(w_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        u = load_rows(ut_ptr, bos, n_rows, h, H, V, C, BV, v0).to(tl.float32) - tl.dot(w, s_op)
        u_op = u.to(DT)
        if STORE_O:
            qg = load_rows(qg_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
            a_qk = load_rows(aqk_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
            o = tl.dot(qg, s_op) + tl.dot(a_qk, u_op)
            store_rows(o_ptr, o, bos, n_rows, h, H, V, C, BV, v0)
        kd = load_rows(kd_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        gl = tl.load(gl_ptr + (ic * H + h).to(tl.int64) * K + kk)
        S = S * gl[:, None] + tl.dot(tl.trans(kd), u_op)
    if STORE_FINAL:
        tl.store(ht_ptr + nh + state_offs, S)
