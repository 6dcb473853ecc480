"""Decayed pair products inside one 16-token sub-chunk, on tensor cores, by dyadic levels.

The scores of a chunk need, for every pair of tokens t >= j, the per-channel decay exp(G_t - G_j)
(G the cumulative log decay, non-increasing along t). Splitting it as exp(G_t) * exp(-G_j) overflows
fp32 under the unbounded softplus gate, so a pair may only be factored through a row r between them,
exp(G_t - G_r) * exp(G_r - G_j) with j < r <= t: both exponents are <= 0, nothing overflows, and r
is never later than the query (no rounding leaks from future tokens).

Pairs of different sub-chunks share one such row (the later sub-chunk's first or the earlier one's
last). Inside a sub-chunk we split it into dyadic levels: at level s (s = 8, 4, 2, 1) every aligned
2s-row block pairs its upper half (queries t) with its lower half (keys j), all factored through
the upper half's first row. Each pair t > j belongs to exactly one level (the highest bit where t
and j differ), so four masked [BC, BK] x [BK, BC] tensor-core products plus the t == j diagonal give
the sub-chunk's pair sums exactly, with one [BC, BK] exp per level instead of one per key row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def level_factors(G_ptr, G, bos_i, n_i, h, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                  c0, level):
    """The factors of level `level` (0..3: half-block size S = 8, 4, 2, 1) for the sub-chunk at token
    bos_i (n_i rows on, G its [BC, BK] cumulative decays, columns c0..c0+BK): (up, lo, same).
    Callers walk the levels in a runtime loop, `for level in range(4)`: unrolled, they held 255
    registers per thread.

    up [BC, BK]: exp(G_t - G_r) on the rows in the upper half of their aligned 2S-block, 0 elsewhere;
    lo [BC, BK]: exp(G_r - G_j) on the rows in the lower half; r is the upper half's first row
    (clamped to the last valid row, so a partial sub-chunk's keys stay <= 1 and its pad rows are 0);
    same [BC, BC]: t and j lie in the same 2S-block (the pairs this level owns, once up and lo pick
    the upper query and lower key)."""
    tl.static_assert(BC == 16, "the kernels walk the 4 levels of 16-row sub-chunks (S = 8, 4, 2, 1)")
    S = BC >> (level + 1)
    x = tl.arange(0, BC)
    upper = (x % (2 * S)) >= S
    lower = (x % (2 * S)) < S
    valid = x < n_i
    ref = tl.maximum(tl.minimum(x - x % (2 * S) + S, n_i - 1), 0)
    offs = ((bos_i + ref).to(tl.int64) * H + h)[:, None] * K + (c0 + tl.arange(0, BK))[None, :]
    g_ref = tl.load(G_ptr + offs, mask=valid[:, None], other=0.0)
    e = tl.exp(tl.minimum(tl.where(upper[:, None], G - g_ref, g_ref - G), 0.0))
    up = tl.where((upper & valid)[:, None], e, 0.0)
    lo = tl.where((lower & valid)[:, None], e, 0.0)
    same = (x[:, None] // (2 * S)) == (x[None, :] // (2 * S))
    return up, lo, same


@triton.jit
def pair_dot(a, b):
    """a @ b of fp32 level operands as tf32 tensor-core inputs (~5e-4 rounding; the products between
    sub-chunks take the model dtype's, bf16's 4e-3)."""
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def diagonal(x, BC: tl.constexpr):
    """The diagonal [BC] of a [BC, BC] tile."""
    t = tl.arange(0, BC)
    return tl.sum(tl.where(t[:, None] == t[None, :], x, 0.0), 1)
