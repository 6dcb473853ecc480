"""Triton KDA forward kernels: the per-chunk prologue, scores and UT inverse, then the state recurrence.

Five launches make the forward; the grids are fine so that every SM holds many small programs (the
per-chunk work is chains of dependent CUDA-core steps: latency, not FLOPs or bytes, bounds it):

1. `chunk_prologue_kernel`, one program per (chunk, column block, head): loads raw q, k, f, fuses L2 norm, gate and
   cumulative decay G, and writes fp32 scratch copies of normalised q, k and of G (the later kernels
   and the backward read them back), plus the decayed q and k the recurrence needs (qg = scale q e^G,
   kd = k e^{G_last - G}), gl = e^{G_last}, and the WY kernel's key operand kbg = beta k e^G in the
   inputs' dtype (so that kernel reads 2 bytes per element instead of fp32 k and G, 8).
2. `chunk_scores_kernel`, one program per (chunk, sub-chunk, head): one 16-row block of the decayed
   scores A_kk = beta P(k, k) (strictly lower) and A_qk = scale P(q, k), where
   P(x, k)[t, j] = sum_c x_t[c] k_j[c] exp(G_t[c] - G_j[c]) for j <= t, and the inverse of the
   block's diagonal part (I + A_kk,ii)^-1 (triton_inverse.py). The decay is never split as
   exp(G_t) * exp(-G_j): exp(-G_j) overflows fp32 under the unbounded softplus gate. Blocks left of
   the diagonal factor it through the sub-chunk's first row r0 (both exponents <= 0) and run on
   tensor cores; pairs inside the diagonal block go by dyadic levels (triton_pair_decay.py), each
   level one tensor-core product with its own factoring row.
3. `chunk_inverse_kernel`, one program per (chunk, head): merges the block inverses into the UT
   inverse M = (I + A_kk)^-1.
4. `chunk_wy_kernel`, one program per (chunk, head): the WY factors w = M kbg, u~ = M (beta v). The
   backward's rerun loads the M the forward saved and skips launches 2 and 3.
5. `chunk_state_kernel`, one program per (sequence, head, V block), a loop over the sequence's
   chunks carrying the fp32 state S [K, BV]:  u = u~ - w S;  o = qg S + A_qk u;
   S <- e^{G_last} * S + kd^T u. It can also store each chunk's start state (for the backward).

Shapes: C chunk (64), BC sub-chunk (16), K key dim, V value dim, H heads, tokens packed as [Ttot, H, X].
Chunk tables: chunk_bos/chunk_eos [NT] token ranges; seq_chunks [N + 1] chunk index ranges.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_inverse import merge_sub_chunk_inverses, sub_chunk_inverse
from kimik3.ops.kda.triton_pair_decay import level_factors, pair_dot
from kimik3.ops.kda.triton_prologue import (chunk_grid_place, chunk_span, gate_fwd, load_row, load_rows,
                                            load_stacked_rows, load_vec, row_rstd, sequence_chunk_span,
                                            sequence_chunks, split_halves, store_rows, store_rows_where,
                                            sub_chunk_span)


@triton.jit
def chunk_prologue_kernel(
    q_ptr, k_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, chunk_bos_ptr, chunk_eos_ptr,
    qg_ptr, kd_ptr, gl_ptr, kn_ptr, qn_ptr, G_ptr, kbg_ptr,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, FORM: tl.constexpr,
):
    """One (chunk, BK-wide column block, head): the per-token prologue. Everything but the L2 norm is
    per channel, so the K columns split across programs (more, smaller programs per SM); each
    program reads its rows in full for the norms."""
    ic, kb, h = chunk_grid_place(K // BK, H)
    c0 = kb * BK
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    rows = tl.arange(0, C)
    valid = rows < n_rows
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    q_rstd, k_rstd = row_rstd(q_ptr, k_ptr, bos, n_rows, h, H, K, C, BK)
    qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
    kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
    f = load_rows(f_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h * K + c0 + tl.arange(0, BK)).to(tl.float32)
    G = tl.cumsum(tl.where(valid[:, None], gate_fwd(f, a_log, dt_bias, FORM, lower_bound), 0.0), 0)
    store_rows(kn_ptr, kn, bos, n_rows, h, H, K, C, BK, c0)
    store_rows(qn_ptr, qn, bos, n_rows, h, H, K, C, BK, c0)
    store_rows(G_ptr, G, bos, n_rows, h, H, K, C, BK, c0)
    g_last = tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), 0)  # pad rows repeat the last valid G
    store_rows(qg_ptr, scale * qn * tl.exp(G), bos, n_rows, h, H, K, C, BK, c0)
    store_rows(kd_ptr, kn * tl.exp(g_last[None, :] - G), bos, n_rows, h, H, K, C, BK, c0)
    beta = tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C))
    store_rows(kbg_ptr, beta[:, None] * kn * tl.exp(G), bos, n_rows, h, H, K, C, BK, c0)
    tl.store(gl_ptr + (ic * H + h).to(tl.int64) * K + c0 + tl.arange(0, BK), tl.exp(g_last))


@triton.jit
def chunk_scores_kernel(
    kn_ptr, qn_ptr, G_ptr, b_ptr, chunk_bos_ptr, chunk_eos_ptr, aqk_ptr, akk_ptr,
    scale,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
):
    """One (chunk, sub-chunk i, head): rows i*BC..(i+1)*BC of A_qk (aqk_ptr, zeros above the diagonal)
    and of A_kk (akk_ptr, fp32: the blocks left of the diagonal, then (I + A_kk,ii)^-1 in its place).

    Keys of earlier sub-chunks go through tensor cores with the decay factored at the sub-chunk's
    first row r0: exp(G_t - G_r0) exp(G_r0 - G_j), both <= 1. Keys of this sub-chunk go by the
    dyadic levels of triton_pair_decay.py."""
    i, h, bos, n_rows, bos_i, n_i = sub_chunk_span(chunk_bos_ptr, chunk_eos_ptr, H, C, BC)  # bos_i, n_i: as a chunk
    if n_i <= 0:  # past the end of a partial last chunk (sub_chunk_span)
        return
    r0 = i * BC
    t = tl.arange(0, BC)
    beta = tl.sigmoid(load_vec(b_ptr, bos_i, n_i, h, H, BC))
    # keys of an earlier sub-chunk: tensor cores, the decay factored at row r0. This sub-chunk's rows
    # are re-read (cache hits) for each jb so that only one [BC, BC] accumulator pair is ever live
    for jb in range(0, i):
        bos_j = bos + jb * BC
        a_kk = tl.zeros((BC, BC), dtype=tl.float32)
        a_qk = tl.zeros((BC, BC), dtype=tl.float32)
        for kb in range(0, K // BK):
            c0 = kb * BK
            g_ref = load_row(G_ptr, bos, n_rows, h, r0, H, K, BK, c0)
            to_ref = tl.exp(tl.minimum(load_rows(G_ptr, bos_i, n_i, h, H, K, BC, BK, c0) - g_ref[None, :], 0.0))
            from_ref = tl.exp(tl.minimum(g_ref[None, :] - load_rows(G_ptr, bos_j, BC, h, H, K, BC, BK, c0), 0.0))
            ys = tl.trans((load_rows(kn_ptr, bos_j, BC, h, H, K, BC, BK, c0) * from_ref).to(DT))
            a_kk += tl.dot((load_rows(kn_ptr, bos_i, n_i, h, H, K, BC, BK, c0) * to_ref).to(DT), ys)
            a_qk += tl.dot((load_rows(qn_ptr, bos_i, n_i, h, H, K, BC, BK, c0) * to_ref).to(DT), ys)
        store_rows(aqk_ptr, scale * a_qk, bos_i, n_i, h, H, C, BC, BC, jb * BC)
        store_rows(akk_ptr, beta[:, None] * a_kk, bos_i, n_i, h, H, C, BC, BC, jb * BC)
    d_kk = tl.zeros((BC, BC), dtype=tl.float32)  # keys of this sub-chunk: by dyadic levels
    d_qk = tl.zeros((BC, BC), dtype=tl.float32)
    for kb in range(0, K // BK):
        c0 = kb * BK
        kn = load_rows(kn_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        qn = load_rows(qn_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        G = load_rows(G_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        d_qk += tl.where(t[:, None] == t[None, :], tl.sum(qn * kn, 1)[:, None], 0.0)
        for level in range(4):  # S = 8, 4, 2, 1
            up, lo, same = level_factors(G_ptr, G, bos_i, n_i, h, H, K, BC, BK, c0, level)
            keys = tl.trans(kn * lo)
            d_kk += tl.where(same, pair_dot(kn * up, keys), 0.0)
            d_qk += tl.where(same, pair_dot(qn * up, keys), 0.0)
    store_rows(aqk_ptr, tl.where(t[:, None] >= t[None, :], scale * d_qk, 0.0), bos_i, n_i, h, H, C, BC, BC, r0)
    store_rows_where(aqk_ptr, tl.zeros((BC, C), dtype=tl.float32), bos_i, n_i, h, H, C, BC, C, 0,
                     tl.arange(0, C) >= r0 + BC)
    a_ii = tl.where(t[:, None] > t[None, :], beta[:, None] * d_kk, 0.0)
    store_rows(akk_ptr, sub_chunk_inverse(a_ii, BC), bos_i, n_i, h, H, C, BC, BC, r0)


@triton.jit
def chunk_inverse_kernel(
    akk_ptr, m_ptr, chunk_bos_ptr, chunk_eos_ptr,
    H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
):
    """One (chunk, head): merges chunk_scores_kernel's block inverses into the UT inverse
    M = (I + A_kk)^-1 (m_ptr, the inputs' dtype; the backward keeps it). A kernel of its own rather than
    the start of chunk_wy_kernel: the merge's ten [BC, BC] blocks and ~fp32 products took that kernel
    from 92 to 247 registers per thread (two programs per SM), and M went through memory there too."""
    ic, _, h = chunk_grid_place(1, H)
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    merge_sub_chunk_inverses(akk_ptr, m_ptr, bos, n_rows, h, H, C, BC)


@triton.jit
def chunk_wy_kernel(
    kbg_ptr, v_ptr, b_ptr, chunk_bos_ptr, chunk_eos_ptr, m_ptr, w_ptr, ut_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
):
    """One (chunk, head): the WY factors w = M kbg (the prologue's beta k e^G, already the dot's operand
    dtype) and u~ = M (beta v), BK columns at a time, from the UT inverse M (chunk_inverse_kernel's in
    the forward, the saved one in the backward's rerun)."""
    ic, _, h = chunk_grid_place(1, H)
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    beta = tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C))
    m_op = load_rows(m_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
    for kb in range(0, K // BK):
        c0 = kb * BK
        kbg = load_rows(kbg_ptr, bos, n_rows, h, H, K, C, BK, c0).to(DT)
        store_rows(w_ptr, tl.dot(m_op, kbg), bos, n_rows, h, H, K, C, BK, c0)
    for vb in range(0, V // BK):
        v = load_rows(v_ptr, bos, n_rows, h, H, V, C, BK, vb * BK).to(tl.float32)
        store_rows(ut_ptr, tl.dot(m_op, (beta[:, None] * v).to(DT)), bos, n_rows, h, H, V, C, BK, vb * BK)


@triton.jit
def chunk_state_kernel(
    w_ptr, ut_ptr, qg_offset, kd_ptr, aqk_ptr, gl_ptr, h0_ptr, o_ptr, hs_ptr, ht_ptr,
    seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_STATES: tl.constexpr, STORE_FINAL: tl.constexpr,
    DT: tl.constexpr,
):
    """One (sequence, head, V block): the chunk-to-chunk state recurrence, optionally emitting o.

    qg lives qg_offset elements after w (function._forward_stages allocates both in one buffer), so
    with STORE_O the kernel loads them as one [2C, K] tile and forms w S and qg S in one tensor-core
    product: each chunk then waits on three products instead of four (Triton waits on every product
    before the next, so each one is a step of the loop's dependent chain)."""
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
    c_first, c_end, seq_bos, seq_eos = sequence_chunks(seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr, n)
    # u~ and e^{G_last} are read into registers, not dot operands that Triton's pipeliner fetches ahead
    # through shared memory: each is loaded one chunk ahead by hand, off the loop's dependent chain
    bos, n_rows = sequence_chunk_span(c_first, c_first, seq_bos, seq_eos, C)
    ut = load_rows(ut_ptr, bos, n_rows, h, H, V, C, BV, v0)
    gl = tl.load(gl_ptr + (c_first * H + h).to(tl.int64) * K + kk, mask=(kk * 0 + c_first) < c_end, other=0.0)
    for ic in range(c_first, c_end):
        bos, n_rows = sequence_chunk_span(ic, c_first, seq_bos, seq_eos, C)
        bos_next, n_next = sequence_chunk_span(ic + 1, c_first, seq_bos, seq_eos, C)  # n_next <= 0 after the last
        ut_next = load_rows(ut_ptr, bos_next, n_next, h, H, V, C, BV, v0)
        gl_next = tl.load(gl_ptr + ((ic + 1) * H + h).to(tl.int64) * K + kk, mask=(kk * 0 + ic + 1) < c_end, other=0.0)
        if STORE_STATES:
            tl.store(hs_ptr + (ic * H + h).to(tl.int64) * K * V + state_offs, S.to(hs_ptr.dtype.element_ty))
        s_op = S.to(DT)
        ut = ut.to(tl.float32)
        if STORE_O:
            w_s, q_s = split_halves(tl.dot(load_stacked_rows(w_ptr, qg_offset, bos, n_rows, h, H, K, C), s_op), C, BV)
            u_op = (ut - w_s).to(DT)
        else:
            u_op = (ut - tl.dot(load_rows(w_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT), s_op)).to(DT)
        kd = load_rows(kd_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        s_next = S * gl[:, None] + tl.dot(tl.trans(kd), u_op)
        if STORE_O:
            a_qk = load_rows(aqk_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
            store_rows(o_ptr, q_s + tl.dot(a_qk, u_op), bos, n_rows, h, H, V, C, BV, v0)
        S = s_next
        ut = ut_next
        gl = gl_next
    if STORE_FINAL:
        tl.store(ht_ptr + nh + state_offs, S)
