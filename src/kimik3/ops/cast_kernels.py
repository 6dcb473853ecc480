"""Triton kernels of ops/cast.py (imported on first CUDA use: Triton is the [gpu] extra)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096
"""Elements per program (8-16 KiB each way)."""


@triton.jit
def _upcast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """src: the bf16 bits as int16, dst: the fp32 bits as int32. Integer moves, so subnormals survive
    (a float conversion may flush them, as the CPU interpreter does)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src_ptr + offs, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    tl.store(dst_ptr + offs, bits.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _downcast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """src: the fp32 bits as int32, dst: the bf16 bits as int16. Round to nearest even in integers
    (add 0x7FFF plus the lowest kept bit, keep the high half), as torch rounds; every NaN becomes the
    quiet NaN 0x7FC0. Integer arithmetic keeps the interpreter's results equal to the GPU's."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src_ptr + offs, mask=mask).to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16)
    tl.store(dst_ptr + offs, out.to(tl.int16, bitcast=True), mask=mask)


_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
"""The integer dtype each float dtype's bits are moved as."""


def _cast(x: Tensor, src: torch.dtype, dst: torch.dtype, kernel) -> Tensor:  # noqa: ANN001 (a Triton kernel)
    """x (src dtype, contiguous) as a new contiguous dst tensor, by `kernel` on the raw bits."""
    if x.dtype != src or not x.is_contiguous():
        raise ValueError(f"the {src} -> {dst} cast takes a contiguous {src} tensor, got {x.dtype} "
                         f"with strides {x.stride()}")
    out = torch.empty(x.shape, dtype=dst, device=x.device)
    n = x.numel()
    if n:
        kernel[(triton.cdiv(n, _BLOCK),)](x.view(_BITS[src]), out.view(_BITS[dst]), n, BLOCK=_BLOCK)
    return out



def upcast_bf16(x: Tensor) -> Tensor:
    """x (bf16, contiguous) as a new contiguous fp32 tensor: bit-identical to `x.float()`."""
    return _cast(x, torch.bfloat16, torch.float32, _upcast_kernel)


def downcast_fp32(x: Tensor) -> Tensor:
    """x (fp32, contiguous) as a new contiguous bf16 tensor: bit-identical to `x.to(bf16)` except for
    NaNs, which stay NaN with another bit pattern (torch's own casts disagree on it between devices)."""
    return _cast(x, torch.float32, torch.bfloat16, _downcast_kernel)
