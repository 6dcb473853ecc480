"""Triton device helpers for the intra-chunk part of KDA: decayed pairwise scores and their adjoints.

Inside a chunk of C tokens with cumulative log decay G [C, K] (G_t = sum_{s<=t} g_s, non-increasing),
every score has the form P[t, j] = sum_c X_t[c] Y_j[c] exp(G_t[c] - G_j[c]) for j <= t. The decay
must never be split as exp(G_t) * exp(-G_j): exp(-G_j) overflows fp32 under the unbounded softplus
gate. So the chunk is cut into NB = C / BC sub-chunks of BC rows:

- off-diagonal blocks (row block i > column block) factor through a reference row r between the two
  blocks, exp(G_t - G_r) * exp(G_r - G_j), both exponents <= 0, and run on tensor cores (tl.dot);
- diagonal blocks form the per-pair decay exactly, one diagonal offset d = t - j at a time:
  each step loads the chunk's normalised q / k and cumulative decay G shifted by d rows from a scratch
  copy the intra kernel wrote (cache-resident) and forms exp(G_t - G_{t-d}) directly. Exponents
  stay <= 0 and every tile is a plain [C, K] tile. Per-offset values never meet the [C, C] tensor-core
  accumulators inside the loop (that costs a shared-memory layout conversion per offset): the forward
  stores each offset's C scores to a per-program scratch tile and reads the blocks back once; the
  backward gathers each offset's dA entries from a scratch copy and accumulates in the loaded layout.

All tiles are [C, BK] column blocks (col0..col0+BK of the K channels): scores sum over blocks and
the contractions are per channel, so callers may split K to bound registers. The three helpers are P itself (forward), its row contraction L (d/dq-side) and its column contraction
R (d/dk-side); each handles the q and k scores at once (A_kk and A_qk share the keys and the decay).
`DT` is the tensor-core operand dtype (the inputs' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_prologue import load_shifted, load_shifted_vec


@triton.jit
def _g_row(G_ptr, bos, n_rows, h, r, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, col0):
    """[BK] cumulative decay of chunk row r from the G scratch (a vector load, not a reduction across warps);
    pad rows r >= n_rows repeat the last valid row, as the in-register G does."""
    row = tl.minimum(r, n_rows - 1)
    return tl.load(G_ptr + ((bos + row).to(tl.int64) * H + h) * K + col0 + tl.arange(0, BK))


@triton.jit
def _block_ref(G_ptr, bos, n_rows, h, col0, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
               BC: tl.constexpr, NB: tl.constexpr, LAST: tl.constexpr):
    """[C, BK]: for each row, G at the first (LAST=False) or last row of its sub-chunk."""
    blk = tl.arange(0, C) // BC
    ref = tl.zeros((C, BK), dtype=tl.float32)
    for i in tl.static_range(NB):
        r = _g_row(G_ptr, bos, n_rows, h, i * BC + (BC - 1 if LAST else 0), H, K, BK, col0)
        ref = tl.where((blk == i)[:, None], r[None, :], ref)
    return ref


@triton.jit
def _shifted_decay(G, G_ptr, bos, n_rows, h, shift, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, col0):
    """exp(-|G_t - G_{t+shift}|) as [C, K]: the exact decay between row t and row t + shift.

    G is non-increasing along the chunk (g <= 0 and the fp32 cumsum stays monotone), so -|.| is
    G_t - G_{t-d} for shift = -d and G_{j+d} - G_j for shift = +d; it also keeps rows outside the
    chunk (loaded as 0, then masked by the caller) finite.
    """
    return tl.exp(-tl.abs(G - load_shifted(G_ptr, bos, n_rows, h, shift, H, K, C, BK, col0)))


@triton.jit
def _band(d_ptr, bos, n_rows, h, d, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BY_ROW: tl.constexpr):
    """[C] entries of diagonal d of a sub-chunk of a lower-triangular [C, C] tile the caller stored as rows
    of d_ptr ([tokens, H, C]): D[t, t - d] for each row t (BY_ROW) or D[j + d, j] for each column j,
    zero where the pair leaves its sub-chunk or the chunk. A gather of C values from cache, in place
    of a masked [C, C] reduction across warps per offset."""
    idx = tl.arange(0, C)
    if BY_ROW:
        r = idx
        ok = idx % BC >= d
    else:
        r = idx + d
        ok = idx % BC + d < BC
    offs = ((bos + r).to(tl.int64) * H + h) * C + r - d
    return tl.load(d_ptr + offs, mask=ok & (r < n_rows), other=0.0)


@triton.jit
def pair_scores(kn, qn, G, kn_ptr, G_ptr, bkk_ptr, bqk_ptr, bos, n_rows, h, col0,
                H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                NB: tl.constexpr, DT: tl.constexpr):
    """(Pkk, Pqk)[t, j] = sum_c {k, q}_t k_j exp(G_t - G_j) for j <= t (zero above).

    bkk_ptr / bqk_ptr: fp32 scratch rows ([tokens, H, C]) of this program: each diagonal offset's C
    values are stored there and the sub-chunk diagonal blocks read back as one tile (adding each
    offset's values into the tensor-core accumulator would convert a [C, C] tile per offset).
    """
    rows = tl.arange(0, C)
    blk = rows // BC
    scale_r = tl.exp(G - _block_ref(G_ptr, bos, n_rows, h, col0, H, K, BK, C, BC, NB, False))
    ka = (kn * scale_r).to(DT)
    qa = (qn * scale_r).to(DT)
    p_kk = tl.zeros((C, C), dtype=tl.float32)
    p_qk = tl.zeros((C, C), dtype=tl.float32)
    for i in range(1, NB):
        r = _g_row(G_ptr, bos, n_rows, h, i * BC, H, K, BK, col0)
        ys = (kn * tl.exp(tl.where(rows[:, None] < i * BC, r[None, :] - G, float("-inf")))).to(DT)
        keep = (blk == i)[:, None]
        p_kk += tl.where(keep, tl.dot(ka, tl.trans(ys)), 0.0)
        p_qk += tl.where(keep, tl.dot(qa, tl.trans(ys)), 0.0)
    _store_band(bkk_ptr, tl.sum(kn * kn, 1), bos, n_rows, h, 0, H, C, BC)
    _store_band(bqk_ptr, tl.sum(qn * kn, 1), bos, n_rows, h, 0, H, C, BC)
    for d in range(1, BC):
        ke = load_shifted(kn_ptr, bos, n_rows, h, -d, H, K, C, BK, col0) * _shifted_decay(G, G_ptr, bos, n_rows, h, -d, H, K, C, BK, col0)
        _store_band(bkk_ptr, tl.sum(kn * ke, 1), bos, n_rows, h, d, H, C, BC)
        _store_band(bqk_ptr, tl.sum(qn * ke, 1), bos, n_rows, h, d, H, C, BC)
    tl.debug_barrier()  # the band values stored by every thread, read back as tiles
    p_kk += _band_tile(bkk_ptr, bos, n_rows, h, H, C, BC)
    p_qk += _band_tile(bqk_ptr, bos, n_rows, h, H, C, BC)
    return p_kk, p_qk


@triton.jit
def _store_band(d_ptr, val, bos, n_rows, h, d, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """Store val[t] at D[t, t - d] of the [C, C] tile kept as rows of d_ptr, where the pair is inside a
    sub-chunk and the chunk (the inverse of _band(..., BY_ROW=True))."""
    t = tl.arange(0, C)
    tl.store(d_ptr + ((bos + t).to(tl.int64) * H + h) * C + t - d, val, mask=(t % BC >= d) & (t < n_rows))


@triton.jit
def _band_tile(d_ptr, bos, n_rows, h, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """The sub-chunk diagonal blocks (lower triangles) of the [C, C] tile kept as rows of d_ptr; zero elsewhere."""
    t = tl.arange(0, C)[:, None]
    j = tl.arange(0, C)[None, :]
    ok = (t // BC == j // BC) & (t >= j) & (t < n_rows)
    return tl.load(d_ptr + ((bos + t).to(tl.int64) * H + h) * C + j, mask=ok, other=0.0)


@triton.jit
def _off_diagonal_rows(d_op, kn, G, G_ptr, bos, n_rows, h, col0, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                       C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr):
    """sum_{j < block start} D[t, j] k_j exp(G_r - G_j) per row t, r the first row of t's sub-chunk (tensor cores)."""
    rows = tl.arange(0, C)
    blk = rows // BC
    acc = tl.zeros(G.shape, dtype=tl.float32)
    for i in range(1, NB):
        r = _g_row(G_ptr, bos, n_rows, h, i * BC, H, K, BK, col0)
        ys = (kn * tl.exp(tl.where(rows[:, None] < i * BC, r[None, :] - G, float("-inf")))).to(DT)
        acc += tl.where((blk == i)[:, None], tl.dot(d_op, ys), 0.0)
    return acc


@triton.jit
def contract_rows(da_op, db_op, da_ptr, db_ptr, kn, G, kn_ptr, G_ptr, bos, n_rows, h, col0,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  NB: tl.constexpr, DT: tl.constexpr):
    """(La, Lb)_t = sum_{j<=t} {Da, Db}[t, j] k_j exp(G_t - G_j) as [C, K] (D lower triangular).

    da_op / db_op: Da / Db as tensor-core operands (DT); da_ptr / db_ptr: the same tiles in fp32 as
    rows of a scratch ([tokens, H, C]), for the sub-chunk diagonals (_band).
    """
    # the sub-chunk diagonals first, in the layout of the loaded tiles (accumulating them into the
    # tensor-core accumulators below would convert a [C, BK] tile through shared memory per offset)
    la = _band(da_ptr, bos, n_rows, h, 0, H, C, BC, True)[:, None] * kn
    lb = _band(db_ptr, bos, n_rows, h, 0, H, C, BC, True)[:, None] * kn
    for d in range(1, BC):
        ke = load_shifted(kn_ptr, bos, n_rows, h, -d, H, K, C, BK, col0) * _shifted_decay(G, G_ptr, bos, n_rows, h, -d, H, K, C, BK, col0)
        la += _band(da_ptr, bos, n_rows, h, d, H, C, BC, True)[:, None] * ke
        lb += _band(db_ptr, bos, n_rows, h, d, H, C, BC, True)[:, None] * ke
    scale_r = tl.exp(G - _block_ref(G_ptr, bos, n_rows, h, col0, H, K, BK, C, BC, NB, False))
    la += _off_diagonal_rows(da_op, kn, G, G_ptr, bos, n_rows, h, col0, H, K, BK, C, BC, NB, DT) * scale_r  # one accumulator live at a time
    lb += _off_diagonal_rows(db_op, kn, G, G_ptr, bos, n_rows, h, col0, H, K, BK, C, BC, NB, DT) * scale_r
    return la, lb


@triton.jit
def contract_cols(da_t, db_t, da_ptr, db_ptr, b_ptr, kn, qn, G, kn_ptr, qn_ptr, G_ptr, bos, n_rows, h, col0,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  NB: tl.constexpr, DT: tl.constexpr):
    """R_j = sum_{t>=j} (beta_t Da[t, j] k_t + Db[t, j] q_t) exp(G_t - G_j) as [C, K] (D lower triangular,
    beta = sigmoid(b)).

    da_t / db_t: (diag(beta) Da)^T / Db^T as tensor-core operands (DT); da_ptr / db_ptr: Da / Db in fp32
    as rows of a scratch ([tokens, H, C]), for the sub-chunk diagonals (_band).
    """
    # the sub-chunk diagonals first (see contract_rows), then the off-diagonal blocks on tensor cores
    beta = tl.sigmoid(load_shifted_vec(b_ptr, bos, n_rows, h, 0, H, C))
    acc = (beta * _band(da_ptr, bos, n_rows, h, 0, H, C, BC, False))[:, None] * kn
    acc += _band(db_ptr, bos, n_rows, h, 0, H, C, BC, False)[:, None] * qn
    for d in range(1, BC):
        ks = load_shifted(kn_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        qs = load_shifted(qn_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        decay = _shifted_decay(G, G_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        dda = tl.sigmoid(load_shifted_vec(b_ptr, bos, n_rows, h, d, H, C)) * _band(da_ptr, bos, n_rows, h, d, H, C, BC, False)
        ddb = _band(db_ptr, bos, n_rows, h, d, H, C, BC, False)
        acc += (dda[:, None] * ks + ddb[:, None] * qs) * decay
    rows = tl.arange(0, C)
    blk = rows // BC
    off = tl.zeros((C, BK), dtype=tl.float32)
    for jb in range(0, NB - 1):
        e = _g_row(G_ptr, bos, n_rows, h, jb * BC + BC - 1, H, K, BK, col0)
        sc = tl.exp(tl.where(rows[:, None] >= (jb + 1) * BC, G - e[None, :], float("-inf")))
        part = tl.dot(da_t, (kn * sc).to(DT)) + tl.dot(db_t, (qn * sc).to(DT))
        off += tl.where((blk == jb)[:, None], part, 0.0)
    return acc + off * tl.exp(_block_ref(G_ptr, bos, n_rows, h, col0, H, K, BK, C, BC, NB, True) - G)


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr, BC: tl.constexpr, LOG2NB: tl.constexpr):
    """(I + A)^-1 for a strictly lower triangular [C, C] A, stable for any A the chunk can produce.

    A power series in A is not: when a chunk's keys are nearly parallel with little decay (trained
    models get there), A has O(1) entries everywhere and the terms of sum_m (-A)^m grow like
    binomial(C, m) ~ 1e18 before cancelling, which fp32 / tf32 turns into inf and NaN. So:
      1. the NB = C / BC diagonal [BC, BC] blocks are inverted together by forward substitution
         (row i of each block from rows < i: BC - 1 steps, each a masked tl.dot in tf32x3, ~fp32);
      2. with D that block-diagonal inverse and L the strictly block-lower part of A,
         I + A = (I + A_diag)(I + D L), and N = D L is nilpotent of index NB, so
         (I + A)^-1 = (I - N + N^2 - ... (-N)^(NB-1)) D: LOG2NB - 1 squarings of a short series whose
         terms are products of true block inverses (no binomial growth).
    """
    rows = tl.arange(0, C)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same_block = (rows // BC)[:, None] == (rows // BC)[None, :]
    sub = rows % BC
    d = eye
    for i in range(1, BC):
        solve = (sub == i)[:, None]
        d = tl.where(solve, eye - tl.dot(tl.where(solve & same_block, A, 0.0), d, input_precision="tf32x3"), d)
    n = -tl.dot(d, tl.where(same_block, 0.0, A), input_precision="tf32x3")
    m = eye + n
    for _ in tl.static_range(1, LOG2NB):
        n = tl.dot(n, n, input_precision="tf32x3")
        m += tl.dot(m, n, input_precision="tf32x3")
    return tl.dot(m, d, input_precision="tf32x3")
