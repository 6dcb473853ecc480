"""The MoE's row permutations: token rows out to their experts' slots, and expert rows back.

Shapes: N tokens, k experts per token, M = N k slots, D hidden. `order` [M] lists the (token, slot)
pairs n k + j sorted by expert (what the experts' grouped GEMM wants); slot_of is its inverse.

    dispatch_rows(x, order, slot_of, k)[i] = x[order[i] // k]                               [M, D]
    combine_rows(routed, order, slot_of, weights)[n] = sum_j weights[n, j] routed[slot_of[n k + j]]   [N, D]
        (optionally widened and with the shared experts' output added, in the same pass)

On CUDA both gathers that sum (dispatch's backward and combine's forward) and combine's backward are
Triton kernels, one program per token that reads its k slot rows directly: an M x D tensor
passes through memory once per direction. The dispatch's own gather is the same kernel, one row per
slot (one launch, where index_select needs the division `order // k` first). The eager form (any device) goes through the unsorted
[M, D] copy: index_copy, multiply, sum and their backwards move it ~8 times, and at the kimi_3b_a1b
shape (N = 8192, k = 8, D = 2048) that was 70 ms of a 379 ms training step on the H200.
Sums are fp32; results round to the rows' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, slot_of: Tensor, k: int, fused: bool):
        ctx.save_for_backward(order, slot_of)
        ctx.k, ctx.fused = k, fused
        if fused and order.numel():
            from kimik3.ops.moe_rows_kernels import gather_rows

            return gather_rows(x.contiguous(), order, k)
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        order, slot_of = ctx.saved_tensors
        M, D = grad.shape
        if ctx.fused:
            from kimik3.ops.moe_rows_kernels import gather_sum

            dx = gather_sum(grad.contiguous(), slot_of, ctx.k, None, grad.dtype)
        else:  # undo the sort (a permutation: a plain index_copy), then each token's k rows
            by_slot = torch.empty_like(grad).index_copy_(0, order, grad)
            dx = by_slot.view(M // ctx.k, ctx.k, D).sum(1, dtype=torch.promote_types(grad.dtype, torch.float32))
        return dx.to(grad.dtype), None, None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routed: Tensor, slot_of: Tensor, weights: Tensor, plus: Optional[Tensor], out_dtype: torch.dtype):
        routed, weights = routed.contiguous(), weights.contiguous()
        ctx.save_for_backward(routed, slot_of, weights)
        ctx.plus_dtype = plus.dtype if plus is not None else None
        from kimik3.ops.moe_rows_kernels import gather_sum

        return gather_sum(routed, slot_of, weights.shape[1], weights, out_dtype,
                          plus.contiguous() if plus is not None else None)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from kimik3.ops.moe_rows_kernels import combine_backward

        routed, slot_of, weights = ctx.saved_tensors
        d_routed, d_weights, d_plus = combine_backward(routed, slot_of, weights, dy, ctx.plus_dtype)
        return d_routed, None, d_weights.to(weights.dtype), d_plus, None


def sort_by_expert(expert_of: Tensor, num_experts: int, fused: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(order [M], slot_of [M], counts [E]) for expert_of [M] (the expert of each (token, slot) pair
    n k + j): the pairs sorted by expert, stably (an expert's pairs keep their order), the inverse
    permutation, and the pairs per expert, all int64 on expert_of's device, with no host sync.

    fused: two Triton launches, a per-block histogram then each pair's slot (default: on CUDA); else
    torch's stable argsort, a scatter-add count and a scatter for the inverse, ~10 launches that cost
    the host more than the GPU at MoE sizes (M = 65,536 pairs of 32 experts at kimi_3b_a1b's 8K)."""
    if _fused(expert_of, fused) and expert_of.numel():  # no pairs: no program would write the counts
        from kimik3.ops.moe_rows_kernels import sort_by_expert as fused_sort

        return fused_sort(expert_of.contiguous(), num_experts)
    order = torch.argsort(expert_of, stable=True)
    # scatter_add: bincount would sync with the host on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_of.device).scatter_add_(
        0, expert_of, torch.ones_like(expert_of))
    return order, invert_permutation(order), counts


def invert_permutation(order: Tensor) -> Tensor:
    """slot_of with slot_of[order[i]] = i (a scatter: no second sort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _fused(x: Tensor, fused: Optional[bool]) -> bool:
    return x.is_cuda if fused is None else fused


def dispatch_rows(x: Tensor, order: Tensor, slot_of: Tensor, k: int, fused: Optional[bool] = None) -> Tensor:
    """x [N, D] -> [M, D], row i = x[order[i] // k] (module docstring). fused: the Triton backward
    (default: on CUDA)."""
    return _DispatchRows.apply(x, order, slot_of, k, _fused(x, fused))


def combine_rows(routed: Tensor, order: Tensor, slot_of: Tensor, weights: Tensor, plus: Optional[Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, fused: Optional[bool] = None) -> Tensor:
    """routed [M, D] sorted by expert, weights [N, k] -> [N, D], the weighted sum of each token's k rows
    (module docstring) in routed's dtype, then widened to out_dtype if given and, if given, plus
    ([N, D], the shared experts' output) added: `sum.to(out_dtype) + plus`, in one pass on CUDA.
    fused: the Triton kernels (default: on CUDA)."""
    N, k = weights.shape
    out_dtype = out_dtype or routed.dtype
    if _fused(routed, fused):
        result_dtype = torch.promote_types(out_dtype, plus.dtype) if plus is not None else out_dtype
        return _CombineRows.apply(routed, slot_of, weights, plus, result_dtype)
    unsorted = torch.empty_like(routed).index_copy(0, order, routed)  # back to (token, slot) order
    y = (unsorted.view(N, k, -1) * weights[..., None].to(unsorted.dtype)).sum(1).to(out_dtype)
    return y + plus if plus is not None else y
