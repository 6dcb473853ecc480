"""Triton kernels of ops/router.py (imported on first fused use: Triton is the [gpu] extra).

One program routes BR tokens; a token's E expert scores sit in one row of a [BR, BE] tile (BE = E
rounded up to a power of two, padded lanes masked), so every selection below is a row reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl
from typing import Optional

from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

BR = 16
"""Tokens per program."""


@triton.jit
def _first_max(x, cols, BE: tl.constexpr):
    """(max [BR], the lowest column holding it [BR]) of each row of x [BR, BE]: a deterministic argmax."""
    best = tl.max(x, 1)
    return best, tl.min(tl.where(x == best[:, None], cols[None, :], BE), 1)


@triton.jit
def _token_tile(N, E: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """This program's tiles: expert columns [BE], chosen columns [BK], the in-bounds masks and element
    offsets of its [BR, BE] expert tile (scores, logits) and its [BR, BK] chosen tile (chosen, weights)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rows64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BE)
    kcols = tl.arange(0, BK)
    mask = (rows < N)[:, None] & (cols < E)[None, :]
    kmask = (rows < N)[:, None] & (kcols < K)[None, :]
    return cols, kcols, mask, rows64 * E + cols[None, :], kmask, rows64 * K + kcols[None, :]


@triton.jit
def _pick(tile, cols, at):
    """tile[r, at[r]] for each row r of a [BR, X] tile (cols: its column ids)."""
    return tl.sum(tl.where(cols[None, :] == at[:, None], tile, 0), 1)


@triton.jit
def _column(tile, kcols, j: tl.constexpr):
    """Column j of a [BR, BK] tile, as [BR] (kcols: its column ids)."""
    return tl.sum(tl.where(kcols[None, :] == j, tile, 0), 1)


@triton.jit
def _group_keep(choice, cols, E: tl.constexpr, BE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                BR: tl.constexpr):
    """[BR, BE] mask of the experts in each token's TOPK_GROUP best groups of E // N_GROUP experts, a
    group ranked by the sum of its two best choice values (ties: the lower group)."""
    size: tl.constexpr = E // N_GROUP
    group_of = cols // size
    gcols = tl.arange(0, N_GROUP)
    group_score = tl.zeros((BR, N_GROUP), dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        inside = tl.where((group_of == g)[None, :], choice, float("-inf"))
        top1, at = _first_max(inside, cols, BE)
        top2 = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), inside), 1)
        group_score = tl.where(gcols[None, :] == g, (top1 + top2)[:, None], group_score)
    keep = tl.zeros((BR, BE), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        _, g_best = _first_max(group_score, gcols, N_GROUP)
        keep = keep | (group_of[None, :] == g_best[:, None])
        group_score = tl.where(gcols[None, :] == g_best[:, None], float("-inf"), group_score)
    return keep


@triton.jit
def _route_fwd_kernel(logits_ptr, bias_ptr, scores_ptr, chosen_ptr, weights_ptr, N, scale,
                      E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BR: tl.constexpr):
    """scores = sigmoid(logits); chosen = the top K of scores + bias (within the best groups), best
    first; weights = the chosen scores / (their sum + 1e-20) * scale."""
    cols, kcols, mask, offs, kmask, koffs = _token_tile(N, E, K, BE, BK, BR)
    scores = tl.sigmoid(tl.load(logits_ptr + offs, mask=mask, other=0.0))
    tl.store(scores_ptr + offs, scores, mask=mask)
    bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
    # NaN (a diverged step's logits; the step is then skipped) ranks below every real value but above
    # the padded lanes and the taken ones (-inf): an all-NaN row still picks K distinct real experts.
    # -1e38, not lower: a group of NaNs scores its top two, -2e38, still finite and above the -inf of a
    # group already taken, so the groups kept stay distinct (at -3e38 the sum overflowed to -inf).
    choice = scores + bias[None, :]
    choice = tl.where(mask, tl.where(choice == choice, choice, -1.0e38), float("-inf"))
    if N_GROUP > 1:
        choice = tl.where(_group_keep(choice, cols, E, BE, N_GROUP, TOPK_GROUP, BR), choice, float("-inf"))
    chosen = tl.zeros((BR, BK), dtype=tl.int64)
    picked = tl.zeros((BR, BK), dtype=tl.float32)
    for j in tl.static_range(K):
        _, at = _first_max(choice, cols, BE)
        chosen = tl.where(kcols[None, :] == j, at.to(tl.int64)[:, None], chosen)
        picked = tl.where(kcols[None, :] == j, _pick(scores, cols, at)[:, None], picked)
        choice = tl.where(cols[None, :] == at[:, None], float("-inf"), choice)
    weights = picked / (tl.sum(picked, 1) + 1e-20)[:, None] * scale
    tl.store(chosen_ptr + koffs, chosen, mask=kmask)
    tl.store(weights_ptr + koffs, weights, mask=kmask)


@triton.jit
def _route_bwd_kernel(scores_ptr, chosen_ptr, d_weights_ptr, d_scores_ptr, d_logits_ptr, N, scale,
                      E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      HAS_D_SCORES: tl.constexpr, BR: tl.constexpr):
    """d logits = (d scores + the weights' gradient taken back to the chosen scores) * s (1 - s). With
    S = sum_j s_cj + 1e-20 and w_j = s_cj / S * scale: d s_cj = scale / S * (dw_j - sum_i dw_i s_ci / S)."""
    cols, kcols, mask, offs, kmask, koffs = _token_tile(N, E, K, BE, BK, BR)
    scores = tl.load(scores_ptr + offs, mask=mask, other=0.0)
    chosen = tl.load(chosen_ptr + koffs, mask=kmask, other=BE).to(tl.int32)
    dw = tl.load(d_weights_ptr + koffs, mask=kmask, other=0.0)
    picked = tl.zeros((BR, BK), dtype=tl.float32)
    for j in tl.static_range(K):
        picked = tl.where(kcols[None, :] == j, _pick(scores, cols, _column(chosen, kcols, j))[:, None], picked)
    total = tl.sum(picked, 1) + 1e-20
    back = scale / total[:, None] * (dw - (tl.sum(dw * picked, 1) / total)[:, None])  # [BR, BK]
    d_scores = tl.zeros((BR, BE), dtype=tl.float32)
    if HAS_D_SCORES:
        d_scores = tl.load(d_scores_ptr + offs, mask=mask, other=0.0)
    for j in tl.static_range(K):
        at = _column(chosen, kcols, j)
        d_scores += tl.where(cols[None, :] == at[:, None], _column(back, kcols, j)[:, None], 0.0)
    tl.store(d_logits_ptr + offs, d_scores * scores * (1.0 - scores), mask=mask)


@triton.jit
def _entropy_kernel(scores_ptr, out_ptr, N, E: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr):
    """out = [sum over tokens of the entropy of p = s / sum(s), tokens], by one program (deterministic)."""
    cols = tl.arange(0, BE)
    acc = tl.zeros((BR,), dtype=tl.float32)
    tokens = tl.zeros((BR,), dtype=tl.float32)  # counted, not N.to(fp32): Triton makes an N of 1 a constexpr
    for start in range(0, N, BR):
        rows = start + tl.arange(0, BR)
        mask = (rows < N)[:, None] & (cols < E)[None, :]
        s = tl.load(scores_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=mask, other=0.0)
        p = s / tl.where(rows < N, tl.sum(s, 1), 1.0)[:, None]  # rows past N: 0 / 1, not 0 / 0
        acc += tl.sum(tl.where(mask, -p * tl.log(tl.maximum(p, 1e-20)), 0.0), 1)
        tokens += tl.where(rows < N, 1.0, 0.0)
    tl.store(out_ptr, tl.sum(acc, 0))
    tl.store(out_ptr + 1, tl.sum(tokens, 0))


def _shape(E: int, k: int) -> dict:
    return dict(E=E, BE=triton.next_power_of_2(E), K=k, BK=triton.next_power_of_2(k), BR=BR)


def route_forward(logits: Tensor, bias: Tensor, scores: Tensor, chosen: Tensor, weights: Tensor, scale: float,
                  n_group: int, topk_group: int) -> None:
    N, E = logits.shape
    _route_fwd_kernel[(triton.cdiv(N, BR),)](logits, bias, scores, chosen, weights, N, scale,
                                            N_GROUP=n_group, TOPK_GROUP=topk_group, **_shape(E, chosen.shape[1]))


def route_backward(scores: Tensor, chosen: Tensor, d_weights: Tensor, d_scores: Optional[Tensor], d_logits: Tensor,
                   scale: float) -> None:
    N, E = scores.shape
    _route_bwd_kernel[(triton.cdiv(N, BR),)](scores, chosen, d_weights, d_scores if d_scores is not None else scores,
                                            d_logits, N, scale, HAS_D_SCORES=d_scores is not None,
                                            **_shape(E, chosen.shape[1]))


def entropy_sum(scores: Tensor, out: Tensor) -> None:
    N, E = scores.shape
    _entropy_kernel[(1,)](scores, out, N, E=E, BE=triton.next_power_of_2(E), BR=64, num_warps=4)
