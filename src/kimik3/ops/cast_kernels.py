"""Triton kernel of ops/cast.py (imported on first CUDA use: Triton is the [gpu] extra)."""

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
