"""A weight's bf16 copy for a bf16 matmul, whose gradient comes back to fp32 in one vectorised pass.

Why: mixed precision keeps fp32 weights and multiplies their bf16 copies, so autograd turns each
bf16 weight gradient back into fp32 with `Tensor.float()`. PyTorch 2.11 runs that bf16 -> fp32 cast
as an unvectorised ("unrolled") elementwise kernel: on the H200 the MoE step's such casts took
16.0 ms of device time per kimi_3b_a1b step at T=8192 (478 calls), ~1.1 TB/s, mostly the expert
weights' gradients (2.3B of its 2.96B parameters). `bf16_weight` does the forward cast as before and
the backward one in a Triton kernel that reads and writes whole 16-byte vectors.

bf16 -> fp32 is exact (the fp32 bits are the bf16 bits followed by 16 zero bits), so the result is
bit-identical to `Tensor.float()`; tests check that on random values, infs, NaNs and subnormals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096
"""Elements per program (8 KiB read, 16 KiB written)."""


@triton.jit
def _upcast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """src: the bf16 bits as int16, dst: the fp32 bits as int32. Integer moves, so subnormals survive
    (a float conversion may flush them, as the CPU interpreter does)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src_ptr + offs, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    tl.store(dst_ptr + offs, bits.to(tl.int32, bitcast=True), mask=mask)


def upcast_bf16(x: Tensor) -> Tensor:
    """x (bf16, contiguous) as a new contiguous fp32 tensor, by the Triton kernel."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"upcast_bf16 takes a contiguous bf16 tensor, got {x.dtype} with strides {x.stride()}")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _upcast_kernel[(triton.cdiv(n, _BLOCK),)](x.view(torch.int16), out.view(torch.int32), n, BLOCK=_BLOCK)
    return out


class _BF16Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        return weight.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if grad.is_cuda and grad.dtype == torch.bfloat16 and grad.is_contiguous():
            return upcast_bf16(grad)
        return grad.float()


def bf16_weight(weight: Tensor) -> Tensor:
    """weight.to(bf16); for an fp32 weight its backward returns the fp32 gradient through
    `upcast_bf16` on CUDA (see the module docstring)."""
    if weight.dtype != torch.float32:
        return weight.to(torch.bfloat16)
    return _BF16Weight.apply(weight)
