"""Triton KDA backward kernels: the reverse state-gradient recurrence, and all input gradients per chunk.

The backward reruns the forward's two kernels (triton_fwd.py) from the saved UT inverse M and scores
A_qk: the intra kernel only redoes the per-token parts, and the recurrence stores each chunk's start
state S0 instead of o. Then:

1. `chunk_dstate_kernel`, one program per (sequence, head, V block), chunks in reverse, carrying
   dS = dL/dS_end [K, BV] in fp32. Per chunk (forward: u = u~ - w S0, o = qg S0 + A_qk u,
   S1 = e^{G_last} S0 + kd^T u):   du = A_qk^T do + kd dS1;   dS0 = e^{G_last} dS1 + qg^T do - w^T du.
   Stores dS1 per chunk, du, and dS0 of each sequence's first chunk (the initial-state gradient).
2. `chunk_intra_bwd_kernel`, one program per (chunk, head), all in parallel: from S0, dS1, du and do
   it forms the gradients of the WY factors and scores, back-propagates through the UT inverse,
   the decayed pairwise scores (triton_intra.py), the cumulative decay, the gate, sigmoid and L2 norm,
   and writes dq, dk, dv, df, db plus per-chunk partial sums for dA_log and ddt_bias.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_intra import contract_cols, contract_rows, store_band
from kimik3.ops.kda.triton_prologue import gate_bwd, load_rows, load_vec, row_rstd, store_rows, store_vec


@triton.jit
def chunk_dstate_kernel(
    do_ptr, qg_ptr, w_ptr, kd_ptr, aqk_ptr, gl_ptr, dht_ptr, dh_ptr, du_ptr, dh0_ptr,
    seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, DT: tl.constexpr,
):
    """One (sequence, head, V block): dS walked from the last chunk to the first."""
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
    c_first = tl.load(seq_chunks_ptr + n)
    c_end = tl.load(seq_chunks_ptr + n + 1)
    for j in range(0, c_end - c_first):
        ic = c_end - 1 - j
        bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
        n_rows = (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)
        tl.store(dh_ptr + (ic * H + h).to(tl.int64) * K * V + state_offs, dS.to(dh_ptr.dtype.element_ty))
        do = load_rows(do_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT)
        a_qk = load_rows(aqk_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
        kd = load_rows(kd_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        du = tl.dot(tl.trans(a_qk), do) + tl.dot(kd, dS.to(DT))
        store_rows(du_ptr, du, bos, n_rows, h, H, V, C, BV, v0)
        qg = load_rows(qg_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        w = load_rows(w_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
        gl = tl.load(gl_ptr + (ic * H + h).to(tl.int64) * K + kk)
        dS = dS * gl[:, None] + tl.dot(tl.trans(qg), do) - tl.dot(tl.trans(w), du.to(DT))
    if HAS_H0:
        tl.store(dh0_ptr + nh + state_offs, dS)


@triton.jit
def chunk_intra_bwd_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, chunk_bos_ptr, chunk_eos_ptr,
    w_ptr, ut_ptr, m_ptr, kn_ptr, qn_ptr, G_ptr, hs_ptr, dh_ptr, du_ptr, do_ptr,
    u_ptr, dxw_ptr, dqn_ptr, dkn_ptr, band_ptr,
    dq_ptr, dk_ptr, dv_ptr, df_ptr, db_ptr, da_part_ptr, ddt_part_ptr,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, FORM: tl.constexpr, DT: tl.constexpr, BAND_SIZE: tl.constexpr,
):
    """One (chunk, head): every input gradient of the chunk (see module docstring).

    Four phases keep only [C, BK] / [C, BV] tiles live; u_ptr, dxw_ptr, dqn_ptr, dkn_ptr are this
    program's own scratch rows (written, then read back after a barrier).
    """
    ic = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = C // BC
    bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
    n_rows = (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)
    rows = tl.arange(0, C)
    valid = rows < n_rows
    beta = tl.where(valid, tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C)), 0.0)
    m_op = load_rows(m_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
    state_base = (ic * H + h).to(tl.int64) * K * V

    # 1. over V blocks: u = u~ - w S0 (kept for phase 3), dA_qk, the u~ part of dA_kk, dv, dbeta
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

    # 2. over K blocks, through the UT inverse: [w | u~] = M X  =>  dX = M^T d[w | u~],
    #    dA_kk = -dX [w | u~]^T, with dw = -du S0^T
    for kb in range(0, K // BK):
        kr = kb * BK + tl.arange(0, BK)
        d_w = tl.zeros((C, BK), dtype=tl.float32)
        for v0 in range(0, V, BV):
            s0 = tl.load(hs_ptr + state_base + kr[:, None] * V + (v0 + tl.arange(0, BV))[None, :]).to(DT)
            d_w -= tl.dot(load_rows(du_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT), tl.trans(s0))
        d_xw = tl.dot(tl.trans(m_op), d_w.to(DT))
        store_rows(dxw_ptr, d_xw, bos, n_rows, h, H, K, C, BK, kb * BK)
        d_akk += tl.dot(d_xw.to(DT), tl.trans(load_rows(w_ptr, bos, n_rows, h, H, K, C, BK, kb * BK).to(DT)))
    d_akk = tl.where(rows[:, None] > rows[None, :], -d_akk, 0.0)
    d_aqk = tl.where(rows[:, None] >= rows[None, :], scale * d_aqk, 0.0)
    band_kk = band_ptr + (ic * H + h).to(tl.int64) * BAND_SIZE * C * BC  # diagonal blocks of dA_kk,
    band_kk_beta = band_kk + C * BC  # beta-scaled dA_kk (the column side: A_kk = beta_t P[t, j])
    band_qk = band_kk + 2 * C * BC  # and dA_qk, for phase 3's sub-chunk loops
    store_band(band_kk, d_akk, C, BC)
    store_band(band_kk_beta, beta[:, None] * d_akk, C, BC)
    store_band(band_qk, d_aqk, C, BC)
    tl.debug_barrier()  # phase 3 reads u, dX_w and the bands back

    # 3. per K block (all channel-local): through the scores, qg = scale q e^G, kd = k e^{G_last - G},
    #    gl = e^{G_last}, X_w = beta k e^G, the cumsum and the gate
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    q_rstd, k_rstd = row_rstd(q_ptr, k_ptr, bos, n_rows, h, H, K, C, BK)
    dot_q = tl.zeros((C,), dtype=tl.float32)  # <qn, dqn> per row, for the L2-norm backward
    dot_k = tl.zeros((C,), dtype=tl.float32)
    d_alog = tl.zeros((C,), dtype=tl.float32)
    for kb in range(0, K // BK):
        c0 = kb * BK
        kr = c0 + tl.arange(0, BK)
        qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
        kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
        G = load_rows(G_ptr, bos, n_rows, h, H, K, C, BK, c0)
        g_last = tl.sum(tl.where(rows[:, None] == n_rows - 1, G, 0.0), 0)
        G = tl.where(valid[:, None], G, g_last[None, :])  # pad rows repeat the last valid G, as in the forward
        # through the pairwise scores A_kk = beta * P(k, k), A_qk = scale * P(q, k)
        l_kk, l_qk = contract_rows(d_akk, d_aqk, kn, G, kn_ptr, G_ptr, band_kk, band_qk, bos, n_rows, h, c0,
                                   H, K, BK, C, BC, NB, DT)
        r_sum = contract_cols(beta[:, None] * d_akk, d_aqk, kn, qn, G, kn_ptr, qn_ptr, G_ptr, band_kk_beta, band_qk,
                              bos, n_rows, h, c0, H, K, BK, C, BC, NB, DT)
        d_beta += tl.sum(kn * l_kk, 1)
        d_kn = beta[:, None] * l_kk + r_sum
        d_qn = l_qk
        d_G = kn * (beta[:, None] * l_kk - r_sum) + qn * l_qk
        # through the state terms qg = scale q e^G, kd = k e^{G_last - G}, gl = e^{G_last}
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
        eg = tl.exp(G)
        d_qn += scale * eg * d_qg
        d_G += scale * qn * eg * d_qg
        e_last = tl.exp(g_last[None, :] - G)
        d_kn += e_last * d_kd
        d_G -= kn * e_last * d_kd
        d_glast = tl.sum(kn * e_last * d_kd, 0) + tl.exp(g_last) * d_gl
        d_G += tl.where(rows[:, None] == C - 1, d_glast[None, :], 0.0)
        # and X_w = beta k e^G (its gradient dX_w from phase 2)
        d_xw = load_rows(dxw_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_beta += tl.sum(d_xw * kn * eg, 1)
        d_kn += beta[:, None] * eg * d_xw
        d_G += beta[:, None] * kn * eg * d_xw
        # G = cumsum(g) -> dg = reverse cumsum; then the gate
        d_g = tl.where(valid[:, None], tl.cumsum(d_G, 0, reverse=True), 0.0)
        f = load_rows(f_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h * K + kr).to(tl.float32)
        d_f, d_a = gate_bwd(d_g, f, a_log, dt_bias, FORM, lower_bound)
        d_f = tl.where(valid[:, None], d_f, 0.0)
        d_alog += tl.sum(tl.where(valid[:, None], d_a, 0.0), 1)
        store_rows(df_ptr, d_f, bos, n_rows, h, H, K, C, BK, c0)
        tl.store(ddt_part_ptr + (ic * H + h).to(tl.int64) * K + kr, tl.sum(d_f, 0))
        dot_q += tl.sum(qn * d_qn, 1)
        dot_k += tl.sum(kn * d_kn, 1)
        store_rows(dqn_ptr, d_qn, bos, n_rows, h, H, K, C, BK, c0)
        store_rows(dkn_ptr, d_kn, bos, n_rows, h, H, K, C, BK, c0)
    tl.store(da_part_ptr + ic * H + h, tl.sum(d_alog, 0))
    store_vec(db_ptr, d_beta * beta * (1.0 - beta), bos, n_rows, h, H, C)
    tl.debug_barrier()  # phase 4 reads dqn / dkn back

    # 4. the L2-norm backward needs the full-row dot products: d x = rstd (d xn - xn <xn, d xn>)
    for kb in range(0, K // BK):
        c0 = kb * BK
        qn = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * q_rstd[:, None]
        kn = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, c0).to(tl.float32) * k_rstd[:, None]
        d_qn = load_rows(dqn_ptr, bos, n_rows, h, H, K, C, BK, c0)
        d_kn = load_rows(dkn_ptr, bos, n_rows, h, H, K, C, BK, c0)
        store_rows(dq_ptr, q_rstd[:, None] * (d_qn - qn * dot_q[:, None]), bos, n_rows, h, H, K, C, BK, c0)
        store_rows(dk_ptr, k_rstd[:, None] * (d_kn - kn * dot_k[:, None]), bos, n_rows, h, H, K, C, BK, c0)
