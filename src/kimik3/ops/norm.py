"""Fused RMSNorm, gated RMSNorm and residual add + RMSNorm (forward and backward in one Triton kernel
each), for CUDA.

Shapes: N rows (all leading dims flattened), D normalised dim, BR rows per tile, BD = D rounded up
to a power of two. Each program walks row tiles [BR, BD] (a persistent grid), so a row is read
once in forward and twice in backward (x and the output gradient) instead of once per eager op.

Numerics are those of the eager modules they replace, roundings included (models/blocks.RMSNorm,
models/kda.GatedRMSNorm; the eager forms stay the reference on other devices and in the tests):

    rms_norm:        y = w * round_x((x * r)),  r = rsqrt(mean(x^2) + eps),  in fp32; y in
                     promote(w, x) (fp32 for fp32 weights): round_x rounds to x's dtype, as
                     `xf.to(x.dtype)` does. Backward: the gradient reaching x * r is
                     round_x(dy * w), as autograd casts it to that intermediate's dtype.
    gated_rms_norm:  y = (w * x * r * sigmoid(g)) in fp32, stored in x's dtype.
    add_rms_norm:    h = x + r (in fp32, rounded to promote(x, r), as eager `x + r`), y = rms_norm(h).
                     Backward: dh_total = round_h(dh + round_h(d rms_norm / dh)), autograd's sum of
                     the two uses of h; dx, dr = dh_total cast to x's and r's dtypes.

add_rms_norm exists for the pre-norm residual stream (models/kimi_k3.Block): `x + branch` followed
by the next norm costs, eagerly, a read of x and r and a write of h, then the norm's read of h; the
fused forward reads x and r and writes h and y in one pass, and the backward adds the residual's
gradient dh while it writes dx, instead of a separate accumulation kernel. That is one full read and
write of the (fp32) residual stream saved per norm, each way.

dw's products accumulate elementwise in fp32 over a program's tiles, are summed over rows once per
program, then summed over the programs. The models call these on CUDA
tensors of fp32/bf16/fp16 (ops.TRITON_FLOAT_DTYPES); elsewhere they run their eager forms.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()  # runtime loop bounds under TRITON_INTERPRET=1 (CPU tests)

_TILE_ELEMS = 2048
"""Elements of one [BR, BD] tile (BR = _TILE_ELEMS // BD rows, at least 1)."""


@triton.jit
def _row_tile(start, N, D, cols, cmask, BR: tl.constexpr):
    """Rows [start, start + BR) of the [N, D] matrix: (row ids, in-bounds mask, element offsets)."""
    rows = start + tl.arange(0, BR)
    return rows, (rows < N)[:, None] & cmask[None, :], rows[:, None] * D + cols[None, :]


@triton.jit
def _rms_fwd_kernel(x_ptr, r_ptr, w_ptr, g_ptr, h_ptr, y_ptr, rstd_ptr, N, D, eps,
                    BR: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """y = norm(x), or with RESIDUAL y = norm(h) for h = x + r (stored to h_ptr, in its dtype)."""
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for start in range(tl.program_id(0) * BR, N, tl.num_programs(0) * BR):
        rows, mask, offs = _row_tile(start, N, D, cols, cmask, BR)
        xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if RESIDUAL:
            rl = tl.load(r_ptr + offs, mask=mask, other=0.0)
            xl = (xl.to(tl.float32) + rl.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + offs, xl, mask=mask)
        x = xl.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BR]
        n = x * rstd[:, None]
        if GATED:
            gate = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = w[None, :] * n * tl.sigmoid(gate)
        else:
            y = w[None, :] * n.to(xl.dtype).to(tl.float32)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < N)


@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, g_ptr, dy_ptr, dh_ptr, rstd_ptr, dx_ptr, dr_ptr, dg_ptr, dw_ptr, N, D,
                    BR: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr, ADD_DH: tl.constexpr,
                    STORE_DR: tl.constexpr):
    """Gradients of the norm of x (of h for add_rms_norm). ADD_DH: plus dh, the gradient of x's other
    uses, summed in x's dtype as autograd sums them. The result goes to dx_ptr in its dtype (for
    add_rms_norm, the dtype of its input x) and, with STORE_DR, to dr_ptr in its (r's) dtype."""
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    # dw's products accumulate elementwise and are summed over rows once, after the loop: a row sum per
    # tile crosses warps (BR rows x BD columns spread over the program's warps). For the gated norm at
    # D = 128 on sm_90: one barrier less per tile, and 63 registers instead of 80; its backward 0.127 ->
    # 0.078 ms per kda_dense_1b layer at T=8192 on an H100 (benchmarks/HISTORY.md, "Memory-bound ops")
    dw = tl.zeros([BR, BD], dtype=tl.float32)
    for start in range(tl.program_id(0) * BR, N, tl.num_programs(0) * BR):
        rows, mask, offs = _row_tile(start, N, D, cols, cmask, BR)
        xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
        x = xl.to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < N, other=0.0)
        n = x * rstd[:, None]
        if GATED:
            gl = tl.load(g_ptr + offs, mask=mask, other=0.0)
            s = tl.sigmoid(gl.to(tl.float32))
            dw += dy * n * s
            dgate = dy * w[None, :] * n * s * (1.0 - s)
            tl.store(dg_ptr + offs, dgate.to(gl.dtype), mask=mask)
            dn = dy * w[None, :] * s
        else:
            dw += dy * n.to(xl.dtype).to(tl.float32)
            dn = (dy * w[None, :]).to(xl.dtype).to(tl.float32)
        dot = tl.sum(dn * x, axis=1) / D  # [BR]
        dx = (rstd[:, None] * dn - (rstd * rstd * rstd * dot)[:, None] * x).to(xl.dtype)
        if ADD_DH:
            dx = (dx.to(tl.float32) + tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(xl.dtype)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if STORE_DR:
            tl.store(dr_ptr + offs, dx.to(dr_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + tl.program_id(0) * D + cols, tl.sum(dw, axis=0), mask=cmask)


def _launch_shape(N: int, D: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BR, BD, programs, warps): tile rows, padded width, a persistent grid of ~4 programs per SM,
    and ~8 tile elements per thread (a handful of live fp32 tiles stay in registers)."""
    bd = triton.next_power_of_2(D)
    br = max(1, _TILE_ELEMS // bd)
    return br, bd, max(1, min(triton.cdiv(N, br), 4 * _sm_count(device))), max(4, min(16, br * bd // 256))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere); cached, as every norm call asks."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _rows(t: Tensor) -> Tensor:
    """t as a contiguous [N, D] matrix."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _check_same_shape(name: str, other: Tensor, x: Tensor) -> None:
    if other.shape != x.shape:
        raise ValueError(f"{name} {tuple(other.shape)} must match x {tuple(x.shape)}")


class _RMSNormFunction(torch.autograd.Function):
    """y = norm(x) (gated when gate is given); with a residual r, h = x + r and y = norm(h), and the
    outputs are (h, y). The backward reads the normalised input (x, or h) and never x and r."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Optional[Tensor], weight: Tensor, gate: Optional[Tensor], eps: float,
                out_dtype: torch.dtype):
        shape, x2 = x.shape, _rows(x)
        N, D = x2.shape
        g2 = _rows(gate) if gate is not None else x2
        r2 = _rows(residual) if residual is not None else x2
        h2 = (torch.empty(N, D, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
              if residual is not None else x2)
        y = torch.empty(N, D, device=x.device, dtype=out_dtype)
        rstd = torch.empty(N, device=x.device, dtype=torch.float32)
        br, bd, progs, warps = _launch_shape(N, D, x.device)
        _rms_fwd_kernel[(progs,)](x2, r2, weight, g2, h2, y, rstd, N, D, eps, BR=br, BD=bd, GATED=gate is not None,
                                  RESIDUAL=residual is not None, num_warps=warps)
        ctx.save_for_backward(h2, weight, g2 if gate is not None else None, rstd)
        ctx.shape, ctx.gated, ctx.out_dtype = shape, gate is not None, out_dtype
        ctx.in_dtypes = (x.dtype, residual.dtype) if residual is not None else None
        ctx.set_materialize_grads(False)  # an unused h (the last norm's) costs no zero tensor
        return (h2.view(shape), y.view(shape)) if residual is not None else y.view(shape)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        h2, weight, g2, rstd = ctx.saved_tensors
        N, D = h2.shape
        dh, dy = grads if ctx.in_dtypes is not None else (None, *grads)
        dy2 = _rows(dy) if dy is not None else torch.zeros(N, D, device=h2.device, dtype=ctx.out_dtype)
        x_dtype, r_dtype = ctx.in_dtypes or (h2.dtype, h2.dtype)
        dx = torch.empty(N, D, device=h2.device, dtype=x_dtype)
        dr = torch.empty(N, D, device=h2.device, dtype=r_dtype) if r_dtype != x_dtype else dx
        dg = torch.empty_like(g2) if ctx.gated else dx
        br, bd, progs, warps = _launch_shape(N, D, h2.device)
        dw_part = torch.empty(progs, D, device=h2.device, dtype=torch.float32)
        _rms_bwd_kernel[(progs,)](h2, weight, g2 if ctx.gated else h2, dy2, _rows(dh) if dh is not None else dy2,
                                  rstd, dx, dr, dg, dw_part, N, D, BR=br, BD=bd, GATED=ctx.gated,
                                  ADD_DH=dh is not None, STORE_DR=dr is not dx, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype)
        dr = dr.view(ctx.shape) if ctx.in_dtypes is not None else None  # dr is dx for equal dtypes, as in autograd
        return dx.view(ctx.shape), dr, dw, dg.view(ctx.shape) if ctx.gated else None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """weight * round_x(x * rsqrt(mean(x^2, -1) + eps)) (module docstring). x: [..., D]; weight: [D].
    Returns promote(weight, x) dtype, the eager module's, unless out_dtype names another (the result
    is then rounded to it once, as a cast of the eager output would)."""
    return _RMSNormFunction.apply(x, None, weight, None, eps, out_dtype or torch.promote_types(weight.dtype, x.dtype))


def add_rms_norm(x: Tensor, r: Tensor, weight: Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + r in promote(x, r) (eager `x + r`), y = rms_norm(h, weight, eps, out_dtype), in
    one pass. x, r: [..., D], the same shape; weight: [D]."""
    _check_same_shape("add_rms_norm: r", r, x)
    h_dtype = torch.promote_types(x.dtype, r.dtype)
    return _RMSNormFunction.apply(x, r, weight, None, eps, out_dtype or torch.promote_types(weight.dtype, h_dtype))


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """(weight * x * rsqrt(mean(x^2, -1) + eps) * sigmoid(gate)) in fp32, returned in x's dtype.
    x, gate: [..., D]; weight: [D]."""
    _check_same_shape("gated_rms_norm: gate", gate, x)
    return _RMSNormFunction.apply(x, None, weight, gate, eps, x.dtype)
