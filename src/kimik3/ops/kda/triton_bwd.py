"""Triton KDA backward kernels: the reverse state-gradient recurrence, then the input gradients per chunk.

The backward reruns the forward's prologue, WY kernel (from the saved UT inverse M) and recurrence
(triton_fwd.py), which now stores each chunk's start state S0 instead of o. Then six launches:

1. `chunk_dstate_kernel`, one program per (sequence, head, V block), chunks in reverse, carrying
   dS = dL/dS_end [K, BV] in fp32. Per chunk (forward: u = u~ - w S0, o = qg S0 + A_qk u,
   S1 = e^{G_last} S0 + kd^T u):   du = A_qk^T do + kd dS1;   dS0 = e^{G_last} dS1 + qg^T do - w^T du.
   Stores dS1 per chunk, du, and dS0 of each sequence's first chunk (the initial-state gradient).
2. `chunk_dwy_kernel`, one program per (chunk, head): back through u, the WY factors and the UT
   inverse to the score gradients dA_kk, dA_qk, and dv.
3. `chunk_dscores_key_kernel` and 4. `chunk_dscores_query_kernel`, one program per (chunk, sub-chunk,
   head) each: back through the decayed scores, with chunk_scores_kernel's factoring of the decay, the
   rows first as keys, then as queries. Each writes its role's sums once (R; L_kk and L_qk) and no
   more: the products with kn, qn and beta that turn them into d(normalised k, q), dG and dbeta are
   left to chunk_dprologue_kernel, which holds kn, qn and beta anyway, so no score gradient is read
   back and rewritten in between.
5. `chunk_dstate_terms_kernel`, one program per (chunk, key-channel block, head): the raw gradients
   of the state's inputs qg, kd and e^{G_last} (two matmuls over V).
6. `chunk_dprologue_kernel`, one program per (chunk, head): takes those through the decays, adds the
   WY and score terms, then goes back through the cumulative decay, the gate, sigmoid and L2 norm: dq, dk, df,
   db, and per-chunk partial sums for dA_log and ddt_bias.
The kernels hand over through fp32 scratch (dA_kk, dA_qk, dX_w, R, L_kk, L_qk, dbeta, and d qg, d kd,
d e^{G_last} in the forward rerun's qn, kn, gl buffers; u in the inputs' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_pair_decay import diagonal, level_factors, pair_dot
from kimik3.ops.kda.triton_prologue import (chunk_grid_place, chunk_head_span, chunk_span, gate_bwd, load_row,
                                            load_rows, load_stacked_rows, load_vec, row_rstd, sequence_chunk_span,
                                            sequence_chunks, stack_halves, store_rows, store_vec, sub_chunk_span)


@triton.jit
def chunk_dstate_kernel(
    do_ptr, qg_offset, w_ptr, kd_ptr, aqk_ptr, gl_ptr, dht_ptr, dh_ptr, du_ptr, dh0_ptr,
    seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, DT: tl.constexpr,
):
    """One (sequence, head, V block): dS walked from the last chunk to the first. qg lives qg_offset
    elements after w, as in chunk_state_kernel."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    kk = tl.arange(0, K)
    state_offs = kk[:, None] * V + (v0 + tl.arange(0, BV))[None, :]
    nh = (n * H + h).to(tl.int64) * K * V
    if HAS_DHT:
        dS = tl.load(dht_ptr + nh + state_offs).to(tl.float32)
    else:
        dS = tl.zeros((K, BV), dtype=tl.float32)
    c_first, c_end, seq_bos, seq_eos = sequence_chunks(seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr, n)
    # do and e^{G_last} are loaded one chunk ahead by hand, as in chunk_state_kernel
    ic = c_end - 1
    bos, n_rows = sequence_chunk_span(ic, c_first, seq_bos, seq_eos, C)
    do = load_rows(do_ptr, bos, tl.where(c_end > c_first, n_rows, 0), h, H, V, C, BV, v0)  # an empty document: none
    gl = tl.load(gl_ptr + (ic * H + h).to(tl.int64) * K + kk, mask=(kk * 0 + ic) >= c_first, other=0.0)
    for j in range(0, c_end - c_first):
        ic = c_end - 1 - j
        bos, n_rows = sequence_chunk_span(ic, c_first, seq_bos, seq_eos, C)
        has_prev = (kk * 0 + ic - 1) >= c_first
        bos_prev, n_prev = sequence_chunk_span(ic - 1, c_first, seq_bos, seq_eos, C)
        do_prev = load_rows(do_ptr, bos_prev, tl.where(ic - 1 >= c_first, n_prev, 0), h, H, V, C, BV, v0)
        gl_prev = tl.load(gl_ptr + ((ic - 1) * H + h).to(tl.int64) * K + kk, mask=has_prev, other=0.0)
        tl.store(dh_ptr + (ic * H + h).to(tl.int64) * K * V + state_offs, dS.to(dh_ptr.dtype.element_ty))
        do = do.to(DT)
        a_qk = load_rows(aqk_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
        kd = load_rows(kd_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        du = tl.dot(tl.trans(a_qk), do) + tl.dot(kd, dS.to(DT))
        store_rows(du_ptr, du, bos, n_rows, h, H, V, C, BV, v0)
        # qg^T do - w^T du as one product over the stacked rows [w; qg] and [-du; do]
        wq = load_stacked_rows(w_ptr, qg_offset, bos, n_rows, h, H, K, C).to(DT)
        dS = dS * gl[:, None] + tl.dot(tl.trans(wq), stack_halves((-du).to(DT), do, C, BV))
        do = do_prev
        gl = gl_prev
    if HAS_H0:
        tl.store(dh0_ptr + nh + state_offs, dS)


@triton.jit
def chunk_dwy_kernel(
    v_ptr, b_ptr, chunk_bos_ptr, chunk_eos_ptr, w_ptr, ut_ptr, m_ptr, hs_ptr, du_ptr, do_ptr,
    u_ptr, dxw_ptr, dakk_ptr, daqk_ptr, dbeta_ptr, dv_ptr,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr,
):
    """One (chunk, head): back through the WY factors and the UT inverse to the scores.

    Writes u = u~ - w S0 (u_ptr, for chunk_dprologue_kernel), dX_w (dxw_ptr), the score gradients
    dA_kk (strictly lower, without beta) and dA_qk (lower, with scale) as fp32 [C, C] rows, dv, and
    the part of dbeta that comes through beta v (dbeta_ptr, fp32; the later kernels add theirs).
    """
    ic, h, bos, n_rows, valid, beta = chunk_head_span(chunk_bos_ptr, chunk_eos_ptr, b_ptr, H, C)
    rows = tl.arange(0, C)
    m_op = load_rows(m_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
    state_base = (ic * H + h).to(tl.int64) * K * V

    # over V blocks: u = u~ - w S0, dA_qk = do u^T, dX_u = M^T du (-> dv, dbeta), and dX_u u~^T of -dA_kk
    d_aqk = tl.zeros((C, C), dtype=tl.float32)
    d_akk = tl.zeros((C, C), dtype=tl.float32)  # dX_u u~^T + dX_w w^T, negated below
    d_beta = tl.zeros((C,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        ut = load_rows(ut_ptr, bos, n_rows, h, H, V, C, BV, v0).to(tl.float32)
        u = ut
        for kb in range(0, K // BK):
            s0 = tl.load(hs_ptr + state_base + (kb * BK + tl.arange(0, BK))[:, None] * V + vv[None, :]).to(DT)
            u -= tl.dot(load_rows(w_ptr, bos, n_rows, h, H, K, C, BK, kb * BK).to(DT), s0)
        store_rows(u_ptr, u, bos, n_rows, h, H, V, C, BV, v0)
        do = load_rows(do_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT)
        du = load_rows(du_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT)
        d_aqk += tl.dot(do, tl.trans(u.to(DT)))
        d_xu = tl.dot(tl.trans(m_op), du)  # grad of beta * v
        store_rows(dv_ptr, beta[:, None] * d_xu, bos, n_rows, h, H, V, C, BV, v0)
        d_beta += tl.sum(d_xu * load_rows(v_ptr, bos, n_rows, h, H, V, C, BV, v0).to(tl.float32), 1)
        d_akk += tl.dot(d_xu.to(DT), tl.trans(ut.to(DT)))

    # over K blocks, through the UT inverse: [w | u~] = M X  =>  dX = M^T d[w | u~],
    # dA_kk = -dX [w | u~]^T, with dw = -du S0^T
    for kb in range(0, K // BK):
        kr = kb * BK + tl.arange(0, BK)
        d_w = tl.zeros((C, BK), dtype=tl.float32)
        for v0 in range(0, V, BV):
            s0 = tl.load(hs_ptr + state_base + kr[:, None] * V + (v0 + tl.arange(0, BV))[None, :]).to(DT)
            d_w -= tl.dot(load_rows(du_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT), tl.trans(s0))
        d_xw = tl.dot(tl.trans(m_op), d_w.to(DT))
        store_rows(dxw_ptr, d_xw, bos, n_rows, h, H, K, C, BK, kb * BK)
        d_akk += tl.dot(d_xw.to(DT), tl.trans(load_rows(w_ptr, bos, n_rows, h, H, K, C, BK, kb * BK).to(DT)))
    store_rows(dakk_ptr, tl.where(rows[:, None] > rows[None, :], -d_akk, 0.0), bos, n_rows, h, H, C, C, C, 0)
    store_rows(daqk_ptr, tl.where(rows[:, None] >= rows[None, :], scale * d_aqk, 0.0), bos, n_rows, h, H, C, C, C, 0)
    store_vec(dbeta_ptr, d_beta, bos, n_rows, h, H, C)


@triton.jit
def chunk_dscores_key_kernel(
    kn_ptr, qn_ptr, G_ptr, b_ptr, chunk_bos_ptr, chunk_eos_ptr, dakk_ptr, daqk_ptr, r_ptr,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
):
    """One (chunk, sub-chunk i, head): back through the decayed scores A_kk = beta P(k, k), A_qk = P(q, k)
    for the rows of sub-chunk i as keys,

        R[j] = sum_{t>=j} (beta_t dA_kk[t, j] k_t + dA_qk[t, j] q_t) e^{G_t - G_j},

    and writes R (r_ptr): the key role's part of d(normalised k); its part of dG, -kn R, is formed by
    chunk_dprologue_kernel. Queries of later sub-chunks go through tensor cores with the decay factored
    at this sub-chunk's last row, so every exponent is <= 0 (chunk_scores_kernel's scheme); the pairs
    inside the sub-chunk go by the dyadic levels of triton_pair_decay.py. The two roles are separate
    kernels: one kernel for both (sharing the level factors) took 1.67 ms on the H200 at 8K x 32 heads
    against 0.66 + 0.81 for the two, and held 255 registers per thread unless limited to 1 pipelining
    stage (168 then)."""
    NB: tl.constexpr = C // BC
    i, h, bos, n_rows, bos_i, n_i = sub_chunk_span(chunk_bos_ptr, chunk_eos_ptr, H, C, BC)
    if n_i <= 0:  # past the end of a partial last chunk (sub_chunk_span)
        return
    r0 = i * BC
    beta = tl.sigmoid(load_vec(b_ptr, bos_i, n_i, h, H, BC))
    d_kk_ii = beta[:, None] * load_rows(dakk_ptr, bos_i, n_i, h, H, C, BC, BC, r0)  # the diagonal block, [t, j]
    d_qk_ii = load_rows(daqk_ptr, bos_i, n_i, h, H, C, BC, BC, r0)
    for kb in range(0, K // BK):
        c0 = kb * BK
        G = load_rows(G_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        r = tl.zeros((BC, BK), dtype=tl.float32)
        if i < NB - 1:  # queries of later sub-chunks, factored at row r0 + BC - 1
            g_last = load_row(G_ptr, bos, n_rows, h, r0 + BC - 1, H, K, BK, c0)
            for tb in range(i + 1, NB):
                bos_t = bos + tb * BC
                n_t = n_rows - tb * BC
                from_ref = tl.exp(tl.minimum(load_rows(G_ptr, bos_t, n_t, h, H, K, BC, BK, c0) - g_last[None, :], 0.0))
                beta_t = tl.sigmoid(load_vec(b_ptr, bos_t, n_t, h, H, BC))
                d_kk = (beta_t[:, None] * load_rows(dakk_ptr, bos_t, n_t, h, H, C, BC, BC, r0)).to(DT)
                d_qk = load_rows(daqk_ptr, bos_t, n_t, h, H, C, BC, BC, r0).to(DT)
                r += tl.dot(tl.trans(d_kk), (load_rows(kn_ptr, bos_t, n_t, h, H, K, BC, BK, c0) * from_ref).to(DT))
                r += tl.dot(tl.trans(d_qk), (load_rows(qn_ptr, bos_t, n_t, h, H, K, BC, BK, c0) * from_ref).to(DT))
            r *= tl.exp(tl.minimum(g_last[None, :] - G, 0.0))
        # pairs inside the sub-chunk (keys j, queries t >= j): the diagonal, then by dyadic levels
        kn = load_rows(kn_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        qn = load_rows(qn_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        r += diagonal(d_qk_ii, BC)[:, None] * qn
        for level in range(4):  # S = 8, 4, 2, 1
            up, lo, same = level_factors(G_ptr, G, bos_i, n_i, h, H, K, BC, BK, c0, level)
            r += lo * (pair_dot(tl.trans(tl.where(same, d_kk_ii, 0.0)), kn * up)
                       + pair_dot(tl.trans(tl.where(same, d_qk_ii, 0.0)), qn * up))
        store_rows(r_ptr, r, bos_i, n_i, h, H, K, BC, BK, c0)


@triton.jit
def chunk_dscores_query_kernel(
    kn_ptr, G_ptr, chunk_bos_ptr, chunk_eos_ptr, dakk_ptr, daqk_ptr, lkk_ptr, lqk_ptr,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
):
    """One (chunk, sub-chunk i, head): the query role of chunk_dscores_key_kernel's rows,

        L_{kk, qk}[t] = sum_{j<=t} dA_{kk, qk}[t, j] k_j e^{G_t - G_j},

    with keys of earlier sub-chunks factored at this sub-chunk's first row. Writes L_kk (lkk_ptr; dA_kk
    without beta) and L_qk (lqk_ptr, the query role's d(normalised q)); chunk_dprologue_kernel adds
    beta L_kk to d(normalised k) and forms their dG and dbeta parts (kn beta L_kk + qn L_qk, and
    sum_c kn L_kk), so this kernel reads no gradient back and needs neither q nor beta."""
    i, h, bos, n_rows, bos_i, n_i = sub_chunk_span(chunk_bos_ptr, chunk_eos_ptr, H, C, BC)
    if n_i <= 0:  # past the end of a partial last chunk (sub_chunk_span)
        return
    r0 = i * BC
    d_kk_ii = load_rows(dakk_ptr, bos_i, n_i, h, H, C, BC, BC, r0)  # the diagonal block, [t, j]
    d_qk_ii = load_rows(daqk_ptr, bos_i, n_i, h, H, C, BC, BC, r0)
    for kb in range(0, K // BK):
        c0 = kb * BK
        G = load_rows(G_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        l_kk = tl.zeros((BC, BK), dtype=tl.float32)
        l_qk = tl.zeros((BC, BK), dtype=tl.float32)
        if i > 0:  # keys of earlier sub-chunks, factored at row r0
            g_first = load_row(G_ptr, bos, n_rows, h, r0, H, K, BK, c0)
            for jb in range(0, i):
                bos_j = bos + jb * BC
                from_ref = tl.exp(tl.minimum(g_first[None, :] - load_rows(G_ptr, bos_j, BC, h, H, K, BC, BK, c0), 0.0))
                ys = (load_rows(kn_ptr, bos_j, BC, h, H, K, BC, BK, c0) * from_ref).to(DT)
                l_kk += tl.dot(load_rows(dakk_ptr, bos_i, n_i, h, H, C, BC, BC, jb * BC).to(DT), ys)
                l_qk += tl.dot(load_rows(daqk_ptr, bos_i, n_i, h, H, C, BC, BC, jb * BC).to(DT), ys)
            to_ref = tl.exp(tl.minimum(G - g_first[None, :], 0.0))
            l_kk *= to_ref
            l_qk *= to_ref
        # pairs inside the sub-chunk (queries t, keys j <= t): the diagonal, then by dyadic levels
        kn = load_rows(kn_ptr, bos_i, n_i, h, H, K, BC, BK, c0)
        l_qk += diagonal(d_qk_ii, BC)[:, None] * kn
        for level in range(4):  # S = 8, 4, 2, 1
            up, lo, same = level_factors(G_ptr, G, bos_i, n_i, h, H, K, BC, BK, c0, level)
            keys = kn * lo
            l_kk += up * pair_dot(tl.where(same, d_kk_ii, 0.0), keys)
            l_qk += up * pair_dot(tl.where(same, d_qk_ii, 0.0), keys)
        store_rows(lkk_ptr, l_kk, bos_i, n_i, h, H, K, BC, BK, c0)
        store_rows(lqk_ptr, l_qk, bos_i, n_i, h, H, K, BC, BK, c0)


@triton.jit
def chunk_dstate_terms_kernel(
    chunk_bos_ptr, chunk_eos_ptr, hs_ptr, dh_ptr, do_ptr, u_ptr, dqg_ptr, dkd_ptr, dgl_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr,
):
    """One (chunk, BK key channels, head): the gradients of the state's inputs, raw.

    The chunk reads its start state S0 through qg (o = qg S0 + ...) and writes the end state through
    kd and gl = e^{G_last} (S1 = gl S0 + kd^T u), so with dS1 the state gradient at the chunk's end:
    d qg = do S0^T, d kd = u dS1^T, d gl = rowsum(S0 * dS1). They are stored as they are, and
    chunk_dprologue_kernel takes them back through the decays: that kernel holds G, q and k anyway, so
    this one stays a pair of matmuls over V (no decay, norm or read-modify-write of the score
    gradients here keeps it at 128 registers where it spilled at 255)."""
    ic, kb, h = chunk_grid_place(K // BK, H)
    c0 = kb * BK
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    kr = c0 + tl.arange(0, BK)
    state_base = (ic * H + h).to(tl.int64) * K * V
    d_qg = tl.zeros((C, BK), dtype=tl.float32)
    d_kd = tl.zeros((C, BK), dtype=tl.float32)
    d_gl = tl.zeros((BK,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs = state_base + kr[:, None] * V + (v0 + tl.arange(0, BV))[None, :]
        s0 = tl.load(hs_ptr + offs).to(DT)
        ds1 = tl.load(dh_ptr + offs).to(DT)
        d_qg += tl.dot(load_rows(do_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT), tl.trans(s0))
        d_kd += tl.dot(load_rows(u_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT), tl.trans(ds1))
        d_gl += tl.sum(s0.to(tl.float32) * ds1.to(tl.float32), 1)
    store_rows(dqg_ptr, d_qg, bos, n_rows, h, H, K, C, BK, c0)
    store_rows(dkd_ptr, d_kd, bos, n_rows, h, H, K, C, BK, c0)
    tl.store(dgl_ptr + (ic * H + h).to(tl.int64) * K + kr, d_gl)


@triton.jit
def chunk_dprologue_kernel(
    q_ptr, k_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, chunk_bos_ptr, chunk_eos_ptr,
    G_ptr, dxw_ptr, dqg_ptr, dkd_ptr, dgl_ptr, dkn_ptr, dqn_ptr, lkk_ptr, dbeta_ptr,
    dq_ptr, dk_ptr, df_ptr, db_ptr, da_part_ptr, ddt_part_ptr,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, FORM: tl.constexpr,
):
    """One (chunk, head): adds the state terms (chunk_dstate_terms_kernel's raw d qg, d kd, d gl), the
    X_w terms and the score terms of the dscores kernels, then goes back through the cumulative decay,
    the gate, sigmoid and L2 norm to dq, dk, df, db and per-chunk partial sums of dA_log and ddt_bias.

    On entry dkn_ptr holds the key role's R, dqn_ptr the query role's L_qk and lkk_ptr its L_kk. L_kk
    enters exactly as e^G dX_w does (both reach k through X_w-shaped terms beta kn (.)), so the two are
    summed first; dG takes -kn R + qn d(qn) + kn beta (e^G dX_w + L_kk). The L2-norm backward needs
    full-row dot products: with BK == K (the default launch up to K = 128) it finishes in the one
    pass; with narrower column blocks the first pass writes the full d(normalised q, k) back (each
    element read before it is overwritten, by the same program) and a second pass re-reads the rows."""
    ic, h, bos, n_rows, valid, beta = chunk_head_span(chunk_bos_ptr, chunk_eos_ptr, b_ptr, H, C)
    rows = tl.arange(0, C)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    q_rstd, k_rstd = row_rstd(q_ptr, k_ptr, bos, n_rows, h, H, K, C, BK)
    dot_q = tl.zeros((C,), dtype=tl.float32)  # <qn, dqn> per row, for the L2-norm backward
    dot_k = tl.zeros((C,), dtype=tl.float32)
    d_alog = tl.zeros((C,), dtype=tl.float32)
    d_beta = load_vec(dbeta_ptr, bos, n_rows, h, H, C)
    for kb in range(0, K // BK):
        c0 = kb * BK
        kr = c0 + tl.arange(0, BK)
        channels = (ic * H + h).to(tl.int64) * K + kr  # this block's channels in the [NT, H, K] per-chunk tensors
        G = load_rows(G_ptr, bos, n_rows, h, H, K, C, BK, c0)
        eg = tl.exp(G)
        # q side: o reads the start state through qg = scale qn e^G, the scores through qn
        qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
        d_qn = load_rows(dqn_ptr, bos, n_rows, h, H, K, C, BK, c0) + scale * eg * load_rows(
            dqg_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_G = qn * d_qn
        dot_q += tl.sum(qn * d_qn, 1)
        if BK == K:  # the whole row is here: finish the L2-norm backward, d x = rstd (d xn - xn <xn, d xn>)
            store_rows(dq_ptr, q_rstd[:, None] * (d_qn - qn * dot_q[:, None]), bos, n_rows, h, H, K, C, BK, c0)
        else:
            store_rows(dqn_ptr, d_qn, bos, n_rows, h, H, K, C, BK, c0)
        # k side: the end state gets kd = kn e^{G_last - G} and gl = e^{G_last}; X_w = beta kn e^G
        # (its gradient dX_w from chunk_dwy_kernel) and A_kk = beta P(k, k) (L_kk) go the same way
        kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
        g_last = tl.sum(tl.where(rows[:, None] == n_rows - 1, G, 0.0), 0)
        d_kn_state = tl.exp(g_last[None, :] - G) * load_rows(dkd_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_xw = eg * load_rows(dxw_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_xw += load_rows(lkk_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_beta += tl.sum(kn * d_xw, 1)
        d_xw *= beta[:, None]
        r_key = load_rows(dkn_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_kn = r_key + d_kn_state + d_xw
        d_G += kn * (d_xw - r_key)
        dot_k += tl.sum(kn * d_kn, 1)
        if BK == K:
            store_rows(dk_ptr, k_rstd[:, None] * (d_kn - kn * dot_k[:, None]), bos, n_rows, h, H, K, C, BK, c0)
        else:
            store_rows(dkn_ptr, d_kn, bos, n_rows, h, H, K, C, BK, c0)
        # G = cumsum(g) -> dg = reverse cumsum. G_last (the last valid row's G) reaches every valid row's g,
        # and its kd part, sum_s kn_s d_kn_state_s, meets the -kn_t d_kn_state_t of every row t <= s in
        # the reverse cumsum: what is left is sum_{s < t}, an exclusive forward cumsum (computing the
        # full sum and letting it cancel loses 5-10x more precision in dA_log on the CPU tests)
        k_run = kn * d_kn_state
        d_g = tl.where(valid[:, None], tl.cumsum(d_G, 0, reverse=True) + tl.cumsum(k_run, 0) - k_run
                       + (tl.exp(g_last) * tl.load(dgl_ptr + channels))[None, :], 0.0)
        f = load_rows(f_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h * K + kr).to(tl.float32)
        d_f, d_a = gate_bwd(d_g, f, a_log, dt_bias, FORM, lower_bound)
        d_f = tl.where(valid[:, None], d_f, 0.0)
        d_alog += tl.sum(tl.where(valid[:, None], d_a, 0.0), 1)
        store_rows(df_ptr, d_f, bos, n_rows, h, H, K, C, BK, c0)
        tl.store(ddt_part_ptr + channels, tl.sum(d_f, 0))
    tl.store(da_part_ptr + ic * H + h, tl.sum(d_alog, 0))
    store_vec(db_ptr, d_beta * beta * (1.0 - beta), bos, n_rows, h, H, C)
    tl.debug_barrier()  # the second pass reads dqn and dkn back

    # with K in blocks, the L2-norm backward needs a second pass for the full-row dot products
    for kb in range(0, K // BK if BK < K else 0):
        c0 = kb * BK
        qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
        kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
        d_qn = load_rows(dqn_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_kn = load_rows(dkn_ptr, bos, n_rows, h, H, K, C, BK, c0)
        store_rows(dq_ptr, q_rstd[:, None] * (d_qn - qn * dot_q[:, None]), bos, n_rows, h, H, K, C, BK, c0)
        store_rows(dk_ptr, k_rstd[:, None] * (d_kn - kn * dot_k[:, None]), bos, n_rows, h, H, K, C, BK, c0)
