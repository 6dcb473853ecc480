"""Triton device helpers for the intra-chunk part of KDA: decayed pairwise scores and their adjoints.

Inside a chunk of C tokens with cumulative log decay G [C, K] (G_t = sum_{s<=t} g_s, non-increasing),
every score has the form P[t, j] = sum_c X_t[c] Y_j[c] exp(G_t[c] - G_j[c]) for j <= t. The decay
must never be split as exp(G_t) * exp(-G_j): exp(-G_j) overflows fp32 under the unbounded softplus
gate. So the chunk is cut into NB = C / BC sub-chunks of BC rows:

- off-diagonal blocks (row block i > column block) factor through a reference row r between the two
  blocks, exp(G_t - G_r) * exp(G_r - G_j), both exponents <= 0, and run on tensor cores (tl.dot);
- diagonal blocks form the per-pair decay exactly, one in-block column at a time ([NB, BC, K] tiles).

The three helpers are P itself (forward), its row contraction L (d/dX) and its column contraction R
(d/dY); each handles two operands at once because the KDA scores come in pairs (A_kk and A_qk share
Y = k and the decay). `DT` is the tensor-core operand dtype (the inputs' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row(x, rows, i):
    """Row i of a [C, X] tile as [X]."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _sub_row(x3, sub, c):
    """Row c of every sub-chunk of a [NB, BC, X] tile as [NB, X]."""
    return tl.sum(tl.where(sub[None, :, None] == c, x3, 0.0), 1)


@triton.jit
def _block_ref(G, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, K: tl.constexpr, LAST: tl.constexpr):
    """[C, K]: for each row, G at the first (LAST=False) or last row of its sub-chunk."""
    sub = tl.arange(0, BC)
    pick = BC - 1 if LAST else 0
    r = _sub_row(tl.reshape(G, (NB, BC, K)), sub, pick)
    return tl.reshape(tl.broadcast_to(r[:, None, :], (NB, BC, K)), (C, K))


@triton.jit
def _expand_diag(d3, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr):
    """[NB, BC, BC] diagonal blocks -> [C, C] block-diagonal matrix."""
    d4 = tl.broadcast_to(tl.reshape(d3, (NB, BC, 1, BC)), (NB, BC, NB, BC))
    nb = tl.arange(0, NB)
    d4 = tl.where(nb[:, None, None, None] == nb[None, None, :, None], d4, 0.0)
    return tl.reshape(d4, (C, C))


@triton.jit
def pair_scores(Xa, Xb, Y, G, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, K: tl.constexpr,
                DT: tl.constexpr):
    """Pa[t, j] = sum_c Xa_t Y_j exp(G_t - G_j) for j <= t (zero above), and Pb likewise with Xb."""
    rows = tl.arange(0, C)
    blk = rows // BC
    scale_r = tl.exp(G - _block_ref(G, C, BC, NB, K, False))
    xa = (Xa * scale_r).to(DT)
    xb = (Xb * scale_r).to(DT)
    pa = tl.zeros((C, C), dtype=tl.float32)
    pb = tl.zeros((C, C), dtype=tl.float32)
    for i in tl.static_range(1, NB):
        r = _row(G, rows, i * BC)
        ys = (Y * tl.exp(tl.where(rows[:, None] < i * BC, r[None, :] - G, float("-inf")))).to(DT)
        keep = (blk == i)[:, None]
        pa += tl.where(keep, tl.dot(xa, tl.trans(ys)), 0.0)
        pb += tl.where(keep, tl.dot(xb, tl.trans(ys)), 0.0)
    sub = tl.arange(0, BC)
    G3 = tl.reshape(G, (NB, BC, K))
    Xa3 = tl.reshape(Xa, (NB, BC, K))
    Xb3 = tl.reshape(Xb, (NB, BC, K))
    Y3 = tl.reshape(Y, (NB, BC, K))
    da = tl.zeros((NB, BC, BC), dtype=tl.float32)
    db = tl.zeros((NB, BC, BC), dtype=tl.float32)
    for c in range(BC):
        decay = tl.exp(tl.where(sub[None, :, None] >= c, G3 - _sub_row(G3, sub, c)[:, None, :], float("-inf")))
        ye = _sub_row(Y3, sub, c)[:, None, :] * decay
        da += tl.where(sub[None, None, :] == c, tl.sum(Xa3 * ye, 2)[:, :, None], 0.0)
        db += tl.where(sub[None, None, :] == c, tl.sum(Xb3 * ye, 2)[:, :, None], 0.0)
    return pa + _expand_diag(da, C, BC, NB), pb + _expand_diag(db, C, BC, NB)


@triton.jit
def contract_rows(Da, Db, Y, G, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, K: tl.constexpr,
                  DT: tl.constexpr):
    """La_t = sum_{j<=t} Da[t, j] Y_j exp(G_t - G_j) [C, K], and Lb likewise (D lower triangular)."""
    rows = tl.arange(0, C)
    blk = rows // BC
    la = tl.zeros((C, K), dtype=tl.float32)
    lb = tl.zeros((C, K), dtype=tl.float32)
    da_op = Da.to(DT)
    db_op = Db.to(DT)
    for i in tl.static_range(1, NB):
        r = _row(G, rows, i * BC)
        ys = (Y * tl.exp(tl.where(rows[:, None] < i * BC, r[None, :] - G, float("-inf")))).to(DT)
        keep = (blk == i)[:, None]
        la += tl.where(keep, tl.dot(da_op, ys), 0.0)
        lb += tl.where(keep, tl.dot(db_op, ys), 0.0)
    scale_r = tl.exp(G - _block_ref(G, C, BC, NB, K, False))
    la *= scale_r
    lb *= scale_r
    sub = tl.arange(0, BC)
    cols = tl.arange(0, C)
    G3 = tl.reshape(G, (NB, BC, K))
    Y3 = tl.reshape(Y, (NB, BC, K))
    la3 = tl.zeros((NB, BC, K), dtype=tl.float32)
    lb3 = tl.zeros((NB, BC, K), dtype=tl.float32)
    for c in range(BC):
        at_c = cols[None, :] == (blk * BC + c)[:, None]  # column c of the row's own sub-chunk
        dca = tl.reshape(tl.sum(tl.where(at_c, Da, 0.0), 1), (NB, BC))
        dcb = tl.reshape(tl.sum(tl.where(at_c, Db, 0.0), 1), (NB, BC))
        decay = tl.exp(tl.where(sub[None, :, None] >= c, G3 - _sub_row(G3, sub, c)[:, None, :], float("-inf")))
        ye = _sub_row(Y3, sub, c)[:, None, :] * decay
        la3 += dca[:, :, None] * ye
        lb3 += dcb[:, :, None] * ye
    return la + tl.reshape(la3, (C, K)), lb + tl.reshape(lb3, (C, K))


@triton.jit
def contract_cols(Da, Xa, Db, Xb, G, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, K: tl.constexpr,
                  DT: tl.constexpr):
    """R_j = sum_{t>=j} (Da[t, j] Xa_t + Db[t, j] Xb_t) exp(G_t - G_j) [C, K] (D lower triangular)."""
    rows = tl.arange(0, C)
    blk = rows // BC
    acc = tl.zeros((C, K), dtype=tl.float32)
    da_t = tl.trans(Da).to(DT)
    db_t = tl.trans(Db).to(DT)
    for jb in tl.static_range(0, NB - 1):
        e = _row(G, rows, jb * BC + BC - 1)
        sc = tl.exp(tl.where(rows[:, None] >= (jb + 1) * BC, G - e[None, :], float("-inf")))
        part = tl.dot(da_t, (Xa * sc).to(DT)) + tl.dot(db_t, (Xb * sc).to(DT))
        acc += tl.where((blk == jb)[:, None], part, 0.0)
    acc *= tl.exp(_block_ref(G, C, BC, NB, K, True) - G)
    sub = tl.arange(0, BC)
    cols = tl.arange(0, C)
    cblk = cols // BC
    G3 = tl.reshape(G, (NB, BC, K))
    Xa3 = tl.reshape(Xa, (NB, BC, K))
    Xb3 = tl.reshape(Xb, (NB, BC, K))
    acc3 = tl.zeros((NB, BC, K), dtype=tl.float32)
    for c in range(BC):
        at_c = rows[:, None] == (cblk * BC + c)[None, :]  # row c of the column's own sub-chunk
        dca = tl.reshape(tl.sum(tl.where(at_c, Da, 0.0), 0), (NB, BC))
        dcb = tl.reshape(tl.sum(tl.where(at_c, Db, 0.0), 0), (NB, BC))
        decay = tl.exp(tl.where(sub[None, :, None] <= c, _sub_row(G3, sub, c)[:, None, :] - G3, float("-inf")))
        acc3 += (dca[:, :, None] * _sub_row(Xa3, sub, c)[:, None, :]
                 + dcb[:, :, None] * _sub_row(Xb3, sub, c)[:, None, :]) * decay
    return acc + tl.reshape(acc3, (C, K))


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr, LOG2C: tl.constexpr):
    """(I + A)^-1 for a strictly lower triangular [C, C] A, as sum_{m<C} (-A)^m by repeated squaring.

    (I + N)(I + N^2)(I + N^4)... = sum_m N^m and N^C = 0, so LOG2C - 1 squarings and as many
    products give the exact inverse in 2 * (LOG2C - 1) tensor-core matmuls.
    """
    rows = tl.arange(0, C)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    n = -A
    m = eye + n
    for _ in tl.static_range(1, LOG2C):
        n = tl.dot(n, n)
        m += tl.dot(m, n)
    return m
