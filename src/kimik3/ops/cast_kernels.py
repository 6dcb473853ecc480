"""Triton kernels of ops/cast.py (imported on first CUDA use: Triton is the [gpu] extra)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096
"""Elements per program (8-16 KiB each way)."""


@triton.jit
def _upcast_bits(bits):
    """bf16 bits (int16) -> the fp32 bits (int32) of the same value. Integer moves, so subnormals
    survive (a float conversion may flush them, as the CPU interpreter does)."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.int32, bitcast=True)


@triton.jit
def _downcast_bits(bits):
    """fp32 bits (int32) -> bf16 bits (int16). Round to nearest even in integers (add 0x7FFF plus the
    lowest kept bit, keep the high half), as torch rounds; every NaN becomes the quiet NaN 0x7FC0.
    Integer arithmetic keeps the interpreter's results equal to the GPU's."""
    bits = bits.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _upcast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """src: the bf16 bits as int16, dst: the fp32 bits as int32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, _upcast_bits(tl.load(src_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _downcast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """src: the fp32 bits as int32, dst: the bf16 bits as int16."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, _downcast_bits(tl.load(src_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _bf16_bits_to_fp32(bits):
    """bf16 bits (as int16) to the fp32 they stand for, exactly."""
    return _upcast_bits(bits).to(tl.float32, bitcast=True)


@triton.jit
def _sum_bf16_kernel(a_ptr, b_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = a + b in fp32; a: bf16 bits as int16 or an fp32 partial sum, b: bf16 bits as int16."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    if a.dtype == tl.int16:
        a = _bf16_bits_to_fp32(a)
    tl.store(dst_ptr + offs, a + _bf16_bits_to_fp32(tl.load(b_ptr + offs, mask=mask)), mask=mask)


_STACK_ALIGN = 4
"""Every element offset in a stack's table is a multiple of this (16 bytes of fp32, 8 of bf16), which
the kernels state so their loads and stores stay vectorised."""

@triton.jit
def _stacked_block(src_ptr, dst_ptr, table_ptr, block_part_ptr, SRC_COLUMN: tl.constexpr, DST_COLUMN: tl.constexpr,
                   DOWN: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Cast one BLOCK of one part (weight) between the table's SRC_COLUMN and DST_COLUMN offsets. A
    table row holds, in elements: the weight's offset from the first weight, its offset in the stacked
    bf16 tensor, its offset in the flat fp32 gradient buffer, its numel, and its first block (program).
    The last, partial block of a part is masked; full blocks are not, so their moves stay 16 bytes
    wide (a mask by a size read from memory would make them scalar)."""
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_part_ptr + pid).to(tl.int64) * 5
    n = tl.load(row + 3)
    start = (pid - tl.load(row + 4)) * BLOCK
    src = src_ptr + tl.multiple_of(tl.load(row + SRC_COLUMN), ALIGN) + start + tl.arange(0, BLOCK)
    dst = dst_ptr + tl.multiple_of(tl.load(row + DST_COLUMN), ALIGN) + start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(dst, _convert_bits(tl.load(src), DOWN))
    else:
        mask = start + tl.arange(0, BLOCK) < n
        tl.store(dst, _convert_bits(tl.load(src, mask=mask), DOWN), mask=mask)


@triton.jit
def _convert_bits(bits, DOWN: tl.constexpr):
    """_downcast_bits (DOWN) or _upcast_bits, chosen at compile time."""
    if DOWN:
        out = _downcast_bits(bits)
    else:
        out = _upcast_bits(bits)
    return out


@triton.jit
def _stacked_downcast_kernel(first_weight_ptr, stacked_ptr, table_ptr, block_part_ptr, BLOCK: tl.constexpr,
                             ALIGN: tl.constexpr):
    """fp32 weights (bits as int32, reached from the first through the table) -> their stack (bf16 bits)."""
    _stacked_block(first_weight_ptr, stacked_ptr, table_ptr, block_part_ptr, 0, 1, True, BLOCK, ALIGN)


@triton.jit
def _stacked_upcast_kernel(stacked_ptr, flat_ptr, table_ptr, block_part_ptr, BLOCK: tl.constexpr,
                           ALIGN: tl.constexpr):
    """The stack's gradient (bf16 bits) -> each weight's fp32 gradient (bits as int32) in one flat buffer."""
    _stacked_block(stacked_ptr, flat_ptr, table_ptr, block_part_ptr, 1, 2, False, BLOCK, ALIGN)


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


@dataclass(frozen=True)
class StackLayout:
    """Where each weight of a stack lives: in memory (from the first weight), in the stacked bf16
    tensor [rows, cols], and in the flat fp32 buffer its gradient is returned in. `parts` holds
    (flat offset, shape) per weight; the device tables are built once per set of weights."""

    table: Tensor
    block_part: Tensor
    rows: int
    cols: int
    parts: tuple[tuple[int, torch.Size], ...]
    flat_numel: int


def stack_layout(weights: Sequence[Tensor]) -> Optional[StackLayout]:
    """The layout for stacking `weights` along their rows, or None when the kernels cannot take them:
    they must be contiguous 2-D fp32 tensors of one column count on one device, each at a 16-byte
    aligned address, and each stacked offset a multiple of 4 elements (rows x cols)."""
    first = weights[0]
    if any(w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or w.shape[1] != first.shape[1]
           or w.device != first.device or w.data_ptr() % 16 for w in weights):
        return None
    if any(w.numel() % _STACK_ALIGN for w in weights[:-1]):
        return None
    return _stack_layout(first.device, tuple((w.data_ptr(), w.shape) for w in weights))


@lru_cache(maxsize=1024)
def _stack_layout(device: torch.device, weights: tuple[tuple[int, torch.Size], ...]) -> StackLayout:
    """Cached on the weights' addresses and shapes (what the table is a function of): the parameters of
    a model keep both from step to step, so a step builds no table and copies nothing to the device."""
    base = weights[0][0]
    rows, stacked, flat, blocks = [], 0, 0, 0
    parts, block_part = [], []
    for i, (ptr, shape) in enumerate(weights):
        n = shape[0] * shape[1]
        n_blocks = triton.cdiv(n, _BLOCK)
        rows.append([(ptr - base) // 4, stacked, flat, n, blocks])
        parts.append((flat, shape))
        block_part += [i] * n_blocks
        stacked, flat, blocks = stacked + n, flat + triton.cdiv(n, _STACK_ALIGN) * _STACK_ALIGN, blocks + n_blocks
    pinned = device.type == "cuda"
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
    block_map = torch.tensor(block_part, dtype=torch.int32, pin_memory=pinned).to(device, non_blocking=True)
    return StackLayout(table, block_map, sum(shape[0] for _, shape in weights), weights[0][1][1], tuple(parts), flat)


def downcast_stacked(weights: Sequence[Tensor], layout: StackLayout) -> Tensor:
    """torch.cat([w.to(bf16) for w in weights]) in one launch (the weights stack_layout gave `layout` for);
    bit-identical to it but for NaN bit patterns, as downcast_fp32."""
    out = torch.empty(layout.rows, layout.cols, dtype=torch.bfloat16, device=weights[0].device)
    _stacked_downcast_kernel[(layout.block_part.numel(),)](
        weights[0].view(torch.int32), out.view(torch.int16), layout.table, layout.block_part, BLOCK=_BLOCK,
        ALIGN=_STACK_ALIGN)
    return out


def upcast_stacked(grad: Tensor, layout: StackLayout) -> list[Tensor]:
    """Each weight's slice of the stack's bf16 gradient [rows, cols] (contiguous), as fp32, in one launch:
    bit-identical to `[g.float() for g in grad.split(...)]`. The results are views of one flat buffer,
    each at a 16-byte-aligned offset (the gradients of a stack live and die together)."""
    if grad.dtype != torch.bfloat16 or not grad.is_contiguous() or grad.shape != (layout.rows, layout.cols):
        raise ValueError(f"upcast_stacked takes a contiguous bf16 [{layout.rows}, {layout.cols}] gradient, got "
                         f"{grad.dtype} {tuple(grad.shape)} with strides {grad.stride()}")
    flat = torch.empty(layout.flat_numel, dtype=torch.float32, device=grad.device)
    _stacked_upcast_kernel[(layout.block_part.numel(),)](
        grad.view(torch.int16), flat.view(torch.int32), layout.table, layout.block_part, BLOCK=_BLOCK,
        ALIGN=_STACK_ALIGN)
    return [flat[offset:offset + shape.numel()].view(shape) for offset, shape in layout.parts]
