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


@triton.jit
def _bf16_bits_to_fp32(bits):
    """bf16 bits (as int16) to the fp32 they stand for, exactly (integer moves: subnormals survive)."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _sum_bf16_kernel(a_ptr, b_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = a + b in fp32; a: bf16 bits as int16 or an fp32 partial sum, b: bf16 bits as int16."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    if a.dtype == tl.int16:
        a = _bf16_bits_to_fp32(a)
    tl.store(dst_ptr + offs, a + _bf16_bits_to_fp32(tl.load(b_ptr + offs, mask=mask)), mask=mask)


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


def sum_bf16(parts: list[Tensor]) -> Tensor:
    """The fp32 sum of two or more bf16 tensors of one shape (contiguous), added left to right in fp32:
    bit-identical to `parts[0].float() + parts[1].float() + ...`. One pass for two parts."""
    if len(parts) < 2 or any(p.dtype != torch.bfloat16 or not p.is_contiguous() or p.shape != parts[0].shape
                             for p in parts):
        raise ValueError(f"sum_bf16 takes two or more contiguous bf16 tensors of one shape, got "
                         f"{[(p.dtype, tuple(p.shape), p.is_contiguous()) for p in parts]}")
    out = torch.empty(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    n = out.numel()
    acc = parts[0].view(torch.int16)
    for part in parts[1:]:
        if n:
            _sum_bf16_kernel[(triton.cdiv(n, _BLOCK),)](acc, part.view(torch.int16), out, n, BLOCK=_BLOCK)
        acc = out
    return out
