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
  stay <= 0 and every tile is a plain [C, K] tile. The d-th diagonal's coefficients (forward: the
  row sums it produces) go through a [C, BC] band of per-program scratch (store_band), read or
  written as one [C] column per step instead of a masked reduction over a [C, C] tile.

All tiles are [C, BK] column blocks (col0..col0+BK of the K channels): scores sum over blocks and
the contractions are per channel, so callers may split K to bound registers. The three helpers are
P itself (forward), its row contraction L (d/dq-side) and its column contraction R (d/dk-side); each
handles the q and k scores at once (A_kk and A_qk share the keys and the decay).
`DT` is the tensor-core operand dtype (the inputs' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_prologue import load_rows, load_shifted, store_rows, store_rows_where


@triton.jit
def _row(x, rows, i):
    """Row i of a [C, X] tile as [X]."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _block_ref(G, rows, BC: tl.constexpr, NB: tl.constexpr, LAST: tl.constexpr):
    """[C, K]: for each row, G at the first (LAST=False) or last row of its sub-chunk."""
    blk = rows // BC
    ref = tl.zeros_like(G)
    for i in tl.static_range(NB):
        r = _row(G, rows, i * BC + (BC - 1 if LAST else 0))
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
def _band_offsets(C: tl.constexpr, BC: tl.constexpr):
    """([C, C] offsets into a [C, BC] band tile, [C, C] mask): entry (t, j) of a diagonal sub-chunk
    block (0 <= t - j <= t % BC) sits at band[t, t - j]; everything else is masked."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    diff = rows[:, None] - cols[None, :]
    return rows[:, None] * BC + diff, (diff >= 0) & (diff <= (rows % BC)[:, None])


@triton.jit
def store_band(band_ptr, x, C: tl.constexpr, BC: tl.constexpr):
    """Scatter the diagonal sub-chunk blocks of a [C, C] tile into the [C, BC] band at band_ptr.

    The sub-chunk loops below need one diagonal of D per step; reading it back as a [C] vector from
    this program's band (cache-resident) replaces a masked reduction over the whole [C, C] tile."""
    offs, inside = _band_offsets(C, BC)
    tl.store(band_ptr + offs, x, mask=inside)


@triton.jit
def _load_band(band_ptr, C: tl.constexpr, BC: tl.constexpr):
    """[C, C] tile holding the band's diagonal sub-chunk blocks (zeros elsewhere)."""
    offs, inside = _band_offsets(C, BC)
    return tl.load(band_ptr + offs, mask=inside, other=0.0)


@triton.jit
def _band_diagonal(band_ptr, d, lower: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """[C, 1] d-th sub-diagonal of the band: D[t, t - d] at row t (lower) or D[j + d, j] at row j.

    Loaded as a column (not a [C] vector broadcast later) so that it lands in the [C, BK] tiles'
    layout without a shared-memory round trip."""
    rows = tl.arange(0, C)[:, None]
    sub = rows % BC
    if lower:
        return tl.load(band_ptr + rows * BC + d, mask=sub >= d, other=0.0)
    return tl.load(band_ptr + (rows + d) * BC + d, mask=sub + d < BC, other=0.0)


@triton.jit
def contract_rows(Da, Db, kn, G, kn_ptr, G_ptr, band_a, band_b, bos, n_rows, h, col0,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  NB: tl.constexpr, DT: tl.constexpr):
    """(La, Lb)_t = sum_{j<=t} {Da, Db}[t, j] k_j exp(G_t - G_j) as [C, K] (D lower triangular).

    band_a / band_b: Da / Db's diagonal blocks as written by store_band."""
    rows = tl.arange(0, C)
    blk = rows // BC
    la = tl.zeros((C, BK), dtype=tl.float32)
    lb = tl.zeros((C, BK), dtype=tl.float32)
    da_op = Da.to(DT)
    db_op = Db.to(DT)
    for i in range(1, NB):
        r = _row(G, rows, i * BC)
        ys = (kn * tl.exp(tl.where(rows[:, None] < i * BC, r[None, :] - G, float("-inf")))).to(DT)
        keep = (blk == i)[:, None]
        la += tl.where(keep, tl.dot(da_op, ys), 0.0)
        lb += tl.where(keep, tl.dot(db_op, ys), 0.0)
    scale_r = tl.exp(G - _block_ref(G, rows, BC, NB, False))
    # the diagonal blocks accumulate apart: adding each step straight into the dot results' layout
    # would convert every [C, BK] term through shared memory (a barrier per step)
    la_diag = _band_diagonal(band_a, 0, True, C, BC) * kn
    lb_diag = _band_diagonal(band_b, 0, True, C, BC) * kn
    for d in range(1, BC):
        ke = load_shifted(kn_ptr, bos, n_rows, h, -d, H, K, C, BK, col0) * _shifted_decay(G, G_ptr, bos, n_rows, h, -d, H, K, C, BK, col0)
        la_diag += _band_diagonal(band_a, d, True, C, BC) * ke
        lb_diag += _band_diagonal(band_b, d, True, C, BC) * ke
    return la * scale_r + la_diag, lb * scale_r + lb_diag


@triton.jit
def contract_cols(Da, Db, kn, qn, G, kn_ptr, qn_ptr, G_ptr, band_a, band_b, bos, n_rows, h, col0,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  NB: tl.constexpr, DT: tl.constexpr):
    """R_j = sum_{t>=j} (Da[t, j] k_t + Db[t, j] q_t) exp(G_t - G_j) as [C, K] (D lower triangular).

    band_a / band_b: Da / Db's diagonal blocks as written by store_band."""
    rows = tl.arange(0, C)
    blk = rows // BC
    acc = tl.zeros((C, BK), dtype=tl.float32)
    da_t = tl.trans(Da).to(DT)
    db_t = tl.trans(Db).to(DT)
    for jb in range(0, NB - 1):
        e = _row(G, rows, jb * BC + BC - 1)
        sc = tl.exp(tl.where(rows[:, None] >= (jb + 1) * BC, G - e[None, :], float("-inf")))
        part = tl.dot(da_t, (kn * sc).to(DT)) + tl.dot(db_t, (qn * sc).to(DT))
        acc += tl.where((blk == jb)[:, None], part, 0.0)
    diag = _band_diagonal(band_a, 0, False, C, BC) * kn + _band_diagonal(band_b, 0, False, C, BC) * qn
    for d in range(1, BC):  # accumulated apart from the dot results, as in contract_rows
        ks = load_shifted(kn_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        qs = load_shifted(qn_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        decay = _shifted_decay(G, G_ptr, bos, n_rows, h, d, H, K, C, BK, col0)
        dda = _band_diagonal(band_a, d, False, C, BC)
        ddb = _band_diagonal(band_b, d, False, C, BC)
        diag += (dda * ks + ddb * qs) * decay
    return acc * tl.exp(_block_ref(G, rows, BC, NB, True) - G) + diag


@triton.jit
def sub_chunk_inverse(A, BC: tl.constexpr):
    """(I + A)^-1 of a strictly lower triangular [BC, BC] fp32 tile by forward substitution.

    Row r of the inverse is e_r - sum_{l<r} A[r, l] (row l): BC - 1 steps of exact fp32 vector work
    (no tensor cores, no power series: a series in A is unstable when a chunk's keys are nearly
    parallel with little decay, tests/ops/test_kda_ut_inverse.py)."""
    idx = tl.arange(0, BC)
    eye = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    inv = eye
    for r in range(1, BC):
        a_r = tl.sum(tl.where(idx[:, None] == r, A, 0.0), 0)  # A[r, :], indexed by the row l it weights
        inv = tl.where(idx[:, None] == r, eye - tl.sum(a_r[:, None] * inv, 0)[None, :], inv)
    return inv


@triton.jit
def _block(ptr, bos, n_rows, h, bi, bj, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """The [BC, BC] block (row block bi, column block bj) of a chunk's [C, C] matrix, as fp32."""
    return load_rows(ptr, bos + bi * BC, n_rows - bi * BC, h, H, C, BC, BC, bj * BC).to(tl.float32)


@triton.jit
def _put(ptr, x, bos, n_rows, h, bi, bj, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    store_rows(ptr, x, bos + bi * BC, n_rows - bi * BC, h, H, C, BC, BC, bj * BC)


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="tf32x3")  # ~fp32 accuracy on tensor cores


@triton.jit
def merge_sub_chunk_inverses(a_ptr, m_ptr, bos, n_rows, h, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """Write M = (I + A)^-1 [C, C] (m_ptr's dtype) from a_ptr's fp32 [C, C] matrix per chunk row,
    which holds the strictly lower blocks A_ij (i > j) and, on the diagonal, the inverted blocks
    D_i = (I + A_ii)^-1 (sub_chunk_inverse). Block forward substitution, from (I + A) M = I:

        M_ii = D_i,   M_ij = -D_i sum_{l=j}^{i-1} A_il M_lj  (i > j),   zeros above.

    Written out for the 4 x 4 blocks of a 64-token chunk (16-token sub-chunks): 16 [16, 16] products
    in ~fp32 instead of masked [64, 64] ones."""
    tl.static_assert(C == 4 * BC, "merge_sub_chunk_inverses is written for 4 sub-chunks per chunk")
    d0 = _block(a_ptr, bos, n_rows, h, 0, 0, H, C, BC)
    d1 = _block(a_ptr, bos, n_rows, h, 1, 1, H, C, BC)
    d2 = _block(a_ptr, bos, n_rows, h, 2, 2, H, C, BC)
    d3 = _block(a_ptr, bos, n_rows, h, 3, 3, H, C, BC)
    a10 = _block(a_ptr, bos, n_rows, h, 1, 0, H, C, BC)
    a20 = _block(a_ptr, bos, n_rows, h, 2, 0, H, C, BC)
    a21 = _block(a_ptr, bos, n_rows, h, 2, 1, H, C, BC)
    a30 = _block(a_ptr, bos, n_rows, h, 3, 0, H, C, BC)
    a31 = _block(a_ptr, bos, n_rows, h, 3, 1, H, C, BC)
    a32 = _block(a_ptr, bos, n_rows, h, 3, 2, H, C, BC)
    m10 = -_mm(d1, _mm(a10, d0))
    m21 = -_mm(d2, _mm(a21, d1))
    m32 = -_mm(d3, _mm(a32, d2))
    m20 = -_mm(d2, _mm(a20, d0) + _mm(a21, m10))
    m31 = -_mm(d3, _mm(a31, d1) + _mm(a32, m21))
    m30 = -_mm(d3, _mm(a30, d0) + _mm(a31, m10) + _mm(a32, m20))
    for i in tl.static_range(3):  # the zero blocks above the diagonal, one row block at a time
        store_rows_where(m_ptr, tl.zeros((BC, C), dtype=tl.float32), bos + i * BC, n_rows - i * BC, h, H, C, BC, C,
                         0, tl.arange(0, C) >= (i + 1) * BC)
    _put(m_ptr, d0, bos, n_rows, h, 0, 0, H, C, BC)
    _put(m_ptr, m10, bos, n_rows, h, 1, 0, H, C, BC)
    _put(m_ptr, d1, bos, n_rows, h, 1, 1, H, C, BC)
    _put(m_ptr, m20, bos, n_rows, h, 2, 0, H, C, BC)
    _put(m_ptr, m21, bos, n_rows, h, 2, 1, H, C, BC)
    _put(m_ptr, d2, bos, n_rows, h, 2, 2, H, C, BC)
    _put(m_ptr, m30, bos, n_rows, h, 3, 0, H, C, BC)
    _put(m_ptr, m31, bos, n_rows, h, 3, 1, H, C, BC)
    _put(m_ptr, m32, bos, n_rows, h, 3, 2, H, C, BC)
    _put(m_ptr, d3, bos, n_rows, h, 3, 3, H, C, BC)
