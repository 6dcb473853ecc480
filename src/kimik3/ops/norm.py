"""Fused RMSNorm and gated RMSNorm (forward and backward in one Triton kernel each), for CUDA.

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

dw is reduced per program in fp32, then summed over the programs. The models call these on CUDA
tensors of fp32/bf16/fp16 (models.blocks.FUSED_NORM_DTYPES); elsewhere they run their eager forms.
"""

from __future__ import annotations

import functools

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
def _rms_fwd_kernel(x_ptr, w_ptr, g_ptr, y_ptr, rstd_ptr, N, D, eps,
                    BR: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr):
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for start in range(tl.program_id(0) * BR, N, tl.num_programs(0) * BR):
        rows, mask, offs = _row_tile(start, N, D, cols, cmask, BR)
        xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
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
def _rms_bwd_kernel(x_ptr, w_ptr, g_ptr, dy_ptr, rstd_ptr, dx_ptr, dg_ptr, dw_ptr, N, D,
                    BR: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr):
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BD], dtype=tl.float32)
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
            dw += tl.sum(dy * n * s, axis=0)
            dgate = dy * w[None, :] * n * s * (1.0 - s)
            tl.store(dg_ptr + offs, dgate.to(gl.dtype), mask=mask)
            dn = dy * w[None, :] * s
        else:
            dw += tl.sum(dy * n.to(xl.dtype).to(tl.float32), axis=0)
            dn = (dy * w[None, :]).to(xl.dtype).to(tl.float32)
        dot = tl.sum(dn * x, axis=1) / D  # [BR]
        dx = rstd[:, None] * dn - (rstd * rstd * rstd * dot)[:, None] * x
        tl.store(dx_ptr + offs, dx.to(xl.dtype), mask=mask)
    tl.store(dw_ptr + tl.program_id(0) * D + cols, dw, mask=cmask)


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


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, out_dtype: torch.dtype):
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        g2 = gate.reshape(-1, D).contiguous() if gate is not None else x2
        N = x2.shape[0]
        y = torch.empty(N, D, device=x.device, dtype=out_dtype)
        rstd = torch.empty(N, device=x.device, dtype=torch.float32)
        br, bd, progs, warps = _launch_shape(N, D, x.device)
        _rms_fwd_kernel[(progs,)](x2, weight, g2, y, rstd, N, D, eps, BR=br, BD=bd, GATED=gate is not None,
                                  num_warps=warps)
        ctx.save_for_backward(x2, weight, g2 if gate is not None else None, rstd)
        ctx.shape, ctx.gated = shape, gate is not None
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, g2, rstd = ctx.saved_tensors
        N, D = x2.shape
        dy2 = dy.reshape(N, D).contiguous()
        dx = torch.empty_like(x2)
        dg = torch.empty_like(g2) if ctx.gated else dx
        br, bd, progs, warps = _launch_shape(N, D, x2.device)
        dw_part = torch.empty(progs, D, device=x2.device, dtype=torch.float32)
        _rms_bwd_kernel[(progs,)](x2, weight, g2 if ctx.gated else x2, dy2, rstd, dx, dg, dw_part, N, D,
                                  BR=br, BD=bd, GATED=ctx.gated, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dw, dg.view(ctx.shape) if ctx.gated else None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * round_x(x * rsqrt(mean(x^2, -1) + eps)) (module docstring). x: [..., D]; weight: [D].
    Returns promote(weight, x) dtype, the eager module's."""
    return _RMSNormFunction.apply(x, weight, None, eps, torch.promote_types(weight.dtype, x.dtype))


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """(weight * x * rsqrt(mean(x^2, -1) + eps) * sigmoid(gate)) in fp32, returned in x's dtype.
    x, gate: [..., D]; weight: [D]."""
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    return _RMSNormFunction.apply(x, weight, gate, eps, x.dtype)
