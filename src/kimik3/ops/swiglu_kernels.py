"""Triton kernels of ops/swiglu.py (imported on first fused use: Triton is the [gpu] extra)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

BR = 4
BI = 512
"""Tile of one program: BR rows x BI columns of a (and the matching columns of each half of h)."""


@triton.jit
def _tile(N, I, BR: tl.constexpr, BI: tl.constexpr):
    """This program's in-bounds mask [BR, BI] and the offsets of its gate elements in h (up is I
    further on) and of its elements in a. The grid is 1-D, column block fastest (the programs in flight
    cover whole rows side by side): CUDA's second grid axis stops at 65,535, and the routed experts of
    kimi_3b_a1b at T = 32768 have 262,144 rows, 65,536 row blocks."""
    col_blocks = tl.cdiv(I, BI)
    pid = tl.program_id(0)
    rows = (pid // col_blocks) * BR + tl.arange(0, BR)
    cols = (pid % col_blocks) * BI + tl.arange(0, BI)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    return mask, rows64 * (2 * I) + cols[None, :], rows64 * I + cols[None, :]


@triton.jit
def _silu_rounded(gate, dtype: tl.constexpr):
    """silu(gate) in fp32, rounded to the stored dtype and widened again (F.silu's output)."""
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, a_ptr, N, I, BR: tl.constexpr, BI: tl.constexpr):
    mask, gate_offs, a_offs = _tile(N, I, BR, BI)
    gate = tl.load(h_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + gate_offs + I, mask=mask, other=0.0).to(tl.float32)
    act = _silu_rounded(gate, h_ptr.dtype.element_ty)
    tl.store(a_ptr + a_offs, (act * up).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, N, I, BR: tl.constexpr, BI: tl.constexpr):
    mask, gate_offs, a_offs = _tile(N, I, BR, BI)
    gate = tl.load(h_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + gate_offs + I, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + a_offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_act = (da * up).to(h_ptr.dtype.element_ty).to(tl.float32)  # the product's gradient, rounded
    tl.store(dh_ptr + gate_offs, (d_act * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + gate_offs + I, (da * _silu_rounded(gate, h_ptr.dtype.element_ty)).to(dh_ptr.dtype.element_ty),
             mask=mask)


def _launch(kernel, h: Tensor, *tensors: Tensor) -> None:
    """kernel over h [..., 2I] and the tensors after it, one program per [BR, BI] tile of a."""
    width = h.shape[-1] // 2
    rows = h.numel() // h.shape[-1]
    kernel[(triton.cdiv(width, BI) * triton.cdiv(rows, BR),)](h, *tensors, rows, width, BR=BR, BI=BI, num_warps=4)


def swiglu_forward(h: Tensor, a: Tensor) -> None:
    """a [..., I] = silu(gate) * up of a contiguous h [..., 2I]."""
    _launch(_swiglu_fwd_kernel, h, a)


def swiglu_backward(h: Tensor, da: Tensor, dh: Tensor) -> None:
    """dh [..., 2I] (d gate | d up) from the contiguous h and da [..., I] (h's dtype)."""
    _launch(_swiglu_bwd_kernel, h, da, dh)
