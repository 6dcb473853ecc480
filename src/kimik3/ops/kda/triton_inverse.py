"""Triton device helpers for the UT transform's inverse M = (I + A_kk)^-1 of one 64-token chunk.

A_kk is strictly lower triangular. A power series in A_kk is not a stable way to invert it: when a
chunk's keys are nearly parallel with little decay (trained models get there), A_kk has O(1)
entries everywhere and the terms of sum_m (-A)^m grow like binomial(64, m) ~ 1e18 before
cancelling, which fp32 turns into inf and NaN. So the inverse is built by substitution only:

1. chunk_scores_kernel inverts each 16 x 16 diagonal block by forward substitution in fp32
   (sub_chunk_inverse), in the same program that computed the block;
2. chunk_inverse_kernel merges the four block inverses with the blocks below the diagonal by block
   forward substitution (merge_sub_chunk_inverses): 16 [16, 16] products in ~fp32 (tf32x3).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kimik3.ops.kda.triton_prologue import load_rows, store_rows, store_rows_where


@triton.jit
def sub_chunk_inverse(A, BC: tl.constexpr):
    """(I + A)^-1 of a strictly lower triangular [BC, BC] fp32 tile by forward substitution.

    Row r of the inverse is e_r - sum_{l<r} A[r, l] (row l): BC - 1 steps of exact fp32 vector work
    (no tensor cores)."""
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
    # each block is stored as soon as it is known, and loaded only where first needed, so that few are
    # live at once (all ten loaded up front held 255 registers per thread at 1 and 2 warps)
    d0 = _block(a_ptr, bos, n_rows, h, 0, 0, H, C, BC)
    d1 = _block(a_ptr, bos, n_rows, h, 1, 1, H, C, BC)
    m10 = -_mm(d1, _mm(_block(a_ptr, bos, n_rows, h, 1, 0, H, C, BC), d0))
    _put(m_ptr, d0, bos, n_rows, h, 0, 0, H, C, BC)
    _put(m_ptr, m10, bos, n_rows, h, 1, 0, H, C, BC)
    _put(m_ptr, d1, bos, n_rows, h, 1, 1, H, C, BC)
    d2 = _block(a_ptr, bos, n_rows, h, 2, 2, H, C, BC)
    a21 = _block(a_ptr, bos, n_rows, h, 2, 1, H, C, BC)
    m21 = -_mm(d2, _mm(a21, d1))
    m20 = -_mm(d2, _mm(_block(a_ptr, bos, n_rows, h, 2, 0, H, C, BC), d0) + _mm(a21, m10))
    _put(m_ptr, m20, bos, n_rows, h, 2, 0, H, C, BC)
    _put(m_ptr, m21, bos, n_rows, h, 2, 1, H, C, BC)
    _put(m_ptr, d2, bos, n_rows, h, 2, 2, H, C, BC)
    d3 = _block(a_ptr, bos, n_rows, h, 3, 3, H, C, BC)
    a31 = _block(a_ptr, bos, n_rows, h, 3, 1, H, C, BC)
    a32 = _block(a_ptr, bos, n_rows, h, 3, 2, H, C, BC)
    m32 = -_mm(d3, _mm(a32, d2))
    m31 = -_mm(d3, _mm(a31, d1) + _mm(a32, m21))
    m30 = -_mm(d3, _mm(_block(a_ptr, bos, n_rows, h, 3, 0, H, C, BC), d0) + _mm(a31, m10) + _mm(a32, m20))
    _put(m_ptr, m30, bos, n_rows, h, 3, 0, H, C, BC)
    _put(m_ptr, m31, bos, n_rows, h, 3, 1, H, C, BC)
    _put(m_ptr, m32, bos, n_rows, h, 3, 2, H, C, BC)
    _put(m_ptr, d3, bos, n_rows, h, 3, 3, H, C, BC)
    for i in tl.static_range(3):  # the zero blocks above the diagonal, one row block at a time
        store_rows_where(m_ptr, tl.zeros((BC, C), dtype=tl.float32), bos + i * BC, n_rows - i * BC, h, H, C, BC, C,
                         0, tl.arange(0, C) >= (i + 1) * BC)
