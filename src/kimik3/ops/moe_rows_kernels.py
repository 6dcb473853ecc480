"""Triton kernels of ops/moe_rows.py (imported on first fused use: Triton is the [gpu] extra)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

BLOCK_D = 1024


@triton.jit
def _gather_sum_kernel(rows_ptr, slot_of_ptr, w_ptr, plus_ptr, out_ptr, D, K: tl.constexpr, WEIGHTED: tl.constexpr,
                       HAS_PLUS: tl.constexpr, BD: tl.constexpr, DIV: tl.constexpr = 1):
    """out[n, block] = sum_j (w[n, j] if WEIGHTED else 1) rows[slot_of[n k + j] // DIV, block], summed in
    fp32 and rounded to the rows' dtype; with HAS_PLUS, plus[n, block] is then added in fp32. (K = 1,
    DIV = k is the dispatch's gather, out[i] = x[order[i] // k]: one row, so its values pass unchanged.)"""
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = d < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(rows_ptr + (tl.load(slot_of_ptr + n * K + j).to(tl.int64) // DIV) * D + d, mask=mask,
                      other=0.0)
        if WEIGHTED:
            acc += tl.load(w_ptr + n * K + j).to(tl.float32) * row.to(tl.float32)
        else:
            acc += row.to(tl.float32)
    total = acc.to(rows_ptr.dtype.element_ty)
    if HAS_PLUS:
        total = total.to(tl.float32) + tl.load(plus_ptr + n * D + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * D + d, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(routed_ptr, slot_of_ptr, w_ptr, dy_ptr, d_routed_ptr, d_w_ptr, d_plus_ptr, D,
                        K: tl.constexpr, HAS_PLUS: tl.constexpr, BD: tl.constexpr):
    """For token n and each of its slots j: d_routed[slot] = w[n, j] dy[n], d_w[n, j] = <dy[n], routed[slot]>
    (the dot needs the whole row, so one program walks all of D), with dy rounded to the routed rows'
    dtype first (the backward of the forward's rounding); with HAS_PLUS, d_plus[n] = dy[n] in its dtype."""
    n = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):
        slot = tl.load(slot_of_ptr + n * K + j).to(tl.int64)
        w = tl.load(w_ptr + n * K + j).to(tl.float32)
        dot = tl.zeros((BD,), dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            mask = d < D
            dy_in = tl.load(dy_ptr + n * D + d, mask=mask, other=0.0)
            if HAS_PLUS and j == 0:
                tl.store(d_plus_ptr + n * D + d, dy_in.to(d_plus_ptr.dtype.element_ty), mask=mask)
            dy = dy_in.to(routed_ptr.dtype.element_ty).to(tl.float32)
            dot += dy * tl.load(routed_ptr + slot * D + d, mask=mask, other=0.0).to(tl.float32)
            tl.store(d_routed_ptr + slot * D + d, (w * dy).to(d_routed_ptr.dtype.element_ty), mask=mask)
        tl.store(d_w_ptr + n * K + j, tl.sum(dot, 0))


def gather_sum(rows: Tensor, slot_of: Tensor, k: int, weights: Optional[Tensor], dtype: torch.dtype,
               plus: Optional[Tensor] = None) -> Tensor:
    """[M // k, D] in `dtype`: each token's k rows summed (weighted if weights are given) in fp32, rounded
    to the rows' dtype, plus `plus` (contiguous [M // k, D]) if given."""
    M, D = rows.shape
    out = rows.new_empty(M // k, D, dtype=dtype)
    _gather_sum_kernel[(M // k, triton.cdiv(D, BLOCK_D))](
        rows, slot_of, weights if weights is not None else slot_of, plus if plus is not None else out, out, D,
        K=k, WEIGHTED=weights is not None, HAS_PLUS=plus is not None, BD=BLOCK_D)
    return out


def gather_rows(x: Tensor, order: Tensor, k: int) -> Tensor:
    """[M, D] with row i = x[order[i] // k], x [N, D] contiguous: the dispatch in one launch (where
    `x.index_select(0, order // k)` takes two)."""
    out = x.new_empty(order.numel(), x.shape[1])
    _gather_sum_kernel[(order.numel(), triton.cdiv(x.shape[1], BLOCK_D))](
        x, order, order, out, out, x.shape[1], K=1, WEIGHTED=False, HAS_PLUS=False, BD=BLOCK_D, DIV=k)
    return out


def combine_backward(routed: Tensor, slot_of: Tensor, weights: Tensor, dy: Tensor,
                     plus_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(d_routed [M, D] in routed's dtype, d_weights [N, k] fp32, d_plus [N, D] in plus_dtype or None) of
    the weighted gather-sum (plus_dtype: the dtype of the `plus` the forward added, if any)."""
    N, k = weights.shape
    d_routed = torch.empty_like(routed)
    d_weights = torch.empty(N, k, device=weights.device, dtype=torch.float32)
    d_plus = torch.empty(dy.shape, device=dy.device, dtype=plus_dtype) if plus_dtype is not None else None
    _combine_bwd_kernel[(N,)](routed, slot_of, weights, dy.contiguous(), d_routed, d_weights,
                              d_plus if d_plus is not None else d_weights, routed.shape[1],
                              K=k, HAS_PLUS=plus_dtype is not None, BD=BLOCK_D)
    return d_routed, d_weights, d_plus


SORT_BLOCK = 256
"""(token, slot) pairs per program of the sort by expert: its [pairs, experts] one-hot tile and that
tile's cumulative sum stay in registers (114 per thread on 8 warps for sm_90; 1024 pairs took 255
and spilled)."""


@triton.jit
def _expert_histogram_kernel(expert_of_ptr, hist_ptr, M, E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """hist[b, e] = how many of block b's pairs go to expert e."""
    b = tl.program_id(0)
    idx = b * BM + tl.arange(0, BM)
    expert = tl.load(expert_of_ptr + idx, mask=idx < M, other=BE).to(tl.int32)  # BE: no column
    cols = tl.arange(0, BE)
    counts = tl.sum((expert[:, None] == cols[None, :]).to(tl.int32), 0)
    tl.store(hist_ptr + b * E + cols, counts, mask=cols < E)


@triton.jit
def _expert_scatter_kernel(expert_of_ptr, hist_ptr, order_ptr, slot_of_ptr, counts_ptr, M, n_blocks,
                           E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr):
    """Each pair's slot in the expert-sorted order, stable (pairs of one expert keep their order):
    the pairs of all lower experts, plus this expert's pairs in earlier blocks, plus the pair's rank
    among this expert's pairs of its block. Writes order[slot] = pair and slot_of[pair] = slot; program
    0 also writes the per-expert counts."""
    b = tl.program_id(0)
    cols = tl.arange(0, BE)
    cmask = cols < E
    totals = tl.zeros((BE,), dtype=tl.int32)
    earlier = tl.zeros((BE,), dtype=tl.int32)
    for first in range(0, n_blocks, HB):  # HB histogram rows per load
        blk = first + tl.arange(0, HB)
        rows = tl.load(hist_ptr + blk[:, None] * E + cols[None, :], mask=(blk < n_blocks)[:, None] & cmask[None, :],
                       other=0)
        totals += tl.sum(rows, 0)
        earlier += tl.sum(tl.where((blk < b)[:, None], rows, 0), 0)
    if b == 0:
        tl.store(counts_ptr + cols, totals.to(tl.int64), mask=cmask)
    base = tl.cumsum(totals, 0) - totals + earlier  # [BE] first slot of this block's pairs of each expert
    idx = b * BM + tl.arange(0, BM)
    valid = idx < M
    expert = tl.load(expert_of_ptr + idx, mask=valid, other=BE).to(tl.int32)
    hits = (expert[:, None] == cols[None, :]).to(tl.int32)  # [BM, BE] one-hot
    rank = tl.sum(tl.where(hits > 0, tl.cumsum(hits, 0), 0), 1) - 1  # among this block's pairs of its expert
    slot = tl.sum(tl.where(hits > 0, base[None, :], 0), 1) + rank
    tl.store(order_ptr + slot, idx.to(tl.int64), mask=valid)
    tl.store(slot_of_ptr + idx, slot.to(tl.int64), mask=valid)


def sort_by_expert(expert_of: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order, slot_of, counts) for expert_of [M] int64 (two launches; see moe_rows.sort_by_expert)."""
    M = expert_of.numel()
    n_blocks = triton.cdiv(M, SORT_BLOCK)
    be = triton.next_power_of_2(num_experts)
    hist = torch.empty(n_blocks, num_experts, device=expert_of.device, dtype=torch.int32)
    order = torch.empty(M, device=expert_of.device, dtype=torch.int64)
    slot_of = torch.empty_like(order)
    counts = torch.empty(num_experts, device=expert_of.device, dtype=torch.int64)
    _expert_histogram_kernel[(n_blocks,)](expert_of, hist, M, E=num_experts, BE=be, BM=SORT_BLOCK, num_warps=4)
    _expert_scatter_kernel[(n_blocks,)](expert_of, hist, order, slot_of, counts, M, n_blocks, E=num_experts, BE=be,
                                        BM=SORT_BLOCK, HB=64, num_warps=8)
    return order, slot_of, counts
