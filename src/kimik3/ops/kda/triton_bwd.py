"""Triton KDA backward kernels: the reverse state-gradient recurrence, and all input gradients per chunk.

The backward reruns the forward's two kernels (triton_fwd.py; the recurrence then stores each chunk's
start state S0 instead of o), then:

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

from kimik3.ops.kda.triton_fwd import chunk_prologue
from kimik3.ops.kda.triton_intra import contract_cols, contract_rows
from kimik3.ops.kda.triton_prologue import gate_bwd, l2norm_bwd, load_rows, load_vec, store_rows, store_vec


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
    dq_ptr, dk_ptr, dv_ptr, df_ptr, db_ptr, da_part_ptr, ddt_part_ptr,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    BV: tl.constexpr, FORM: tl.constexpr, DT: tl.constexpr,
):
    """One (chunk, head): every input gradient of the chunk (see module docstring)."""
    ic = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = C // BC
    bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
    n_rows = (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)
    rows = tl.arange(0, C)
    kk = tl.arange(0, K)
    beta = tl.where(rows < n_rows, tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C)), 0.0)
    w_op = load_rows(w_ptr, bos, n_rows, h, H, K, C, K, 0).to(DT)
    m_op = load_rows(m_ptr, bos, n_rows, h, H, C, C, C, 0).to(DT)
    state_base = (ic * H + h).to(tl.int64) * K * V

    # gradients through the state terms, one V block at a time (the [C, K] prologue tiles are
    # recomputed only after this loop, to keep its register footprint small)
    d_qg = tl.zeros((C, K), dtype=tl.float32)
    d_kd = tl.zeros((C, K), dtype=tl.float32)
    d_w = tl.zeros((C, K), dtype=tl.float32)
    d_gl = tl.zeros((K,), dtype=tl.float32)
    d_aqk = tl.zeros((C, C), dtype=tl.float32)
    d_akk = tl.zeros((C, C), dtype=tl.float32)  # minus the u~ part of dA_kk, finished below
    d_beta = tl.zeros((C,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        state_offs = kk[:, None] * V + (v0 + tl.arange(0, BV))[None, :]
        s0 = tl.load(hs_ptr + state_base + state_offs).to(DT)  # [K, BV]
        ds1 = tl.load(dh_ptr + state_base + state_offs).to(DT)
        du = load_rows(du_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT)
        do = load_rows(do_ptr, bos, n_rows, h, H, V, C, BV, v0).to(DT)
        ut = load_rows(ut_ptr, bos, n_rows, h, H, V, C, BV, v0).to(tl.float32)
        u = (ut - tl.dot(w_op, s0)).to(DT)
        d_aqk += tl.dot(do, tl.trans(u))
        d_qg += tl.dot(do, tl.trans(s0))
        d_kd += tl.dot(u, tl.trans(ds1))
        d_w -= tl.dot(du, tl.trans(s0))
        d_gl += tl.sum(s0.to(tl.float32) * ds1.to(tl.float32), 1)
        d_xu = tl.dot(tl.trans(m_op), du)  # grad of beta * v
        v = load_rows(v_ptr, bos, n_rows, h, H, V, C, BV, v0).to(tl.float32)
        store_rows(dv_ptr, beta[:, None] * d_xu, bos, n_rows, h, H, V, C, BV, v0)
        d_beta += tl.sum(d_xu * v, 1)
        d_akk += tl.dot(d_xu.to(DT), tl.trans(ut.to(DT)))

    # through the UT inverse: [w | u~] = M X  =>  dX = M^T d[w | u~],  dA_kk = -dX [w | u~]^T
    d_xw = tl.dot(tl.trans(m_op), d_w.to(DT))
    d_akk = -(d_akk + tl.dot(d_xw.to(DT), tl.trans(w_op)))
    d_akk = tl.where(rows[:, None] > rows[None, :], d_akk, 0.0)
    d_aqk = tl.where(rows[:, None] >= rows[None, :], scale * d_aqk, 0.0)

    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
    qn, q_rstd, kn, k_rstd, G, _ = chunk_prologue(q_ptr, k_ptr, f_ptr, b_ptr, bos, n_rows, h, a_log, dt_bias,
                                                     lower_bound, H, K, C, FORM)
    # through X_w = beta k e^G, qg = scale q e^G, kd = k e^{G_last - G}, gl = e^{G_last}
    eg = tl.exp(G)
    kg = kn * eg
    d_beta += tl.sum(d_xw * kg, 1)
    d_kn = beta[:, None] * eg * d_xw
    d_G = beta[:, None] * kg * d_xw
    d_qn = scale * eg * d_qg
    d_G += scale * qn * eg * d_qg
    g_last = tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), 0)
    e_last = tl.exp(g_last[None, :] - G)
    d_kn += e_last * d_kd
    d_G -= kn * e_last * d_kd
    d_glast = tl.sum(kn * e_last * d_kd, 0) + tl.exp(g_last) * d_gl
    d_G += tl.where(rows[:, None] == C - 1, d_glast[None, :], 0.0)

    # through the pairwise scores A_kk = beta * P(k, k), A_qk = scale * P(q, k)
    l_kk, l_qk = contract_rows(d_akk, d_aqk, kn, G, kn_ptr, G_ptr, bos, n_rows, h, H, K, C, BC, NB, DT)
    r_sum = contract_cols(beta[:, None] * d_akk, d_aqk, kn, qn, G, kn_ptr, qn_ptr, G_ptr, bos, n_rows, h,
                          H, K, C, BC, NB, DT)
    d_beta += tl.sum(kn * l_kk, 1)
    d_kn += beta[:, None] * l_kk + r_sum
    d_qn += l_qk
    d_G += kn * (beta[:, None] * l_kk - r_sum) + qn * l_qk

    # G = cumsum(g) -> dg = reverse cumsum; then the gate, sigmoid and L2 norm
    d_g = tl.where((rows < n_rows)[:, None], tl.cumsum(d_G, 0, reverse=True), 0.0)
    f = load_rows(f_ptr, bos, n_rows, h, H, K, C, K, 0).to(tl.float32)
    d_f, d_alog = gate_bwd(d_g, f, a_log, dt_bias, FORM, lower_bound)
    d_f = tl.where((rows < n_rows)[:, None], d_f, 0.0)
    d_alog = tl.where((rows < n_rows)[:, None], d_alog, 0.0)
    store_rows(df_ptr, d_f, bos, n_rows, h, H, K, C, K, 0)
    tl.store(da_part_ptr + ic * H + h, tl.sum(tl.sum(d_alog, 1), 0))
    tl.store(ddt_part_ptr + (ic * H + h).to(tl.int64) * K + kk, tl.sum(d_f, 0))
    store_vec(db_ptr, d_beta * beta * (1.0 - beta), bos, n_rows, h, H, C)
    store_rows(dq_ptr, l2norm_bwd(qn, q_rstd, d_qn), bos, n_rows, h, H, K, C, K, 0)
    store_rows(dk_ptr, l2norm_bwd(kn, k_rstd, d_kn), bos, n_rows, h, H, K, C, K, 0)
