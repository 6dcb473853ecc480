"""Causal depthwise short convolution + SiLU in the [B, T, C] layout, as Triton kernels (CUDA).

Shapes: B batch, T time, C channels (split into P equal parts Cp = C / P on output), W kernel width,
BT x BC the tile of one program.

    z[b, t, c] = sum_w x[b, t - (W-1) + w, c] * weight[c, w]    (zeros before t = 0)
    y = SiLU(z), returned as P contiguous tensors [B, T, Cp] (q, k, v for KDA)

The eager form (models/kda.causal_short_conv: F.conv1d on a transposed, padded copy, then SiLU
and a transpose back) moves the activations through memory several times, and its q, k, v come out
as strided views that the KDA op copies again. Here the forward reads x once (x may be a strided
slice of a wider projection output: only its row stride is needed) and writes y once, split.

Numerics follow the eager path under autocast: the weight is cast to x's dtype, products summed in
fp32, z rounded to x's dtype (the conv output), SiLU in fp32 rounded to x's dtype. The backward
recomputes z: dz = dy * SiLU'(z) (kept in fp32, one launch per part reading that part's gradient),
then dx[t] = sum_w dz[t + (W-1) - w] * weight[c, w] and dweight[c, w] = sum over b, t of
dz[b, t, c] * x[b, t - (W-1) + w, c] (fp32 partial sums per time block, then summed). A single
kernel that recomputed dz for each tap instead of storing it (W^2 + W loads of x per tile) took
14.7 ms per kda_dense_1b training step at T=8192 on the H200, against 7.0 ms for the dx kernel here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BT = 64
BC = 64
"""Tile of one program: BT time rows x BC channels. The grids put the channel block on axis 0, which
varies fastest, so the programs in flight read the same BT rows side by side across all channels
(whole contiguous rows of x and dz) rather than one 128-byte channel slice of rows walking down the
sequence at the row stride."""


@triton.jit
def _conv_z(x_ptr, w_ptr, b, t, c, T, C, sxb, sxt, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Pre-activation z [BT, BC] (fp32, rounded to x's dtype) at times t [BT], channels c [BC]."""
    cmask = c < C
    z = tl.zeros([BT, BC], dtype=tl.float32)
    for w in tl.static_range(W):
        src = t - (W - 1) + w
        ok = (src >= 0) & (src < T)
        xw = tl.load(x_ptr + b * sxb + src[:, None] * sxt + c[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
        wt = tl.load(w_ptr + c * W + w, mask=cmask, other=0.0)
        z += xw.to(tl.float32) * wt.to(tl.float32)[None, :]
    return z.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _tile(T, C, CP, BT: tl.constexpr, BC: tl.constexpr):
    """This program's batch row b, times t [BT], channels c [BC], in-bounds mask [BT, BC] and the
    offsets of those elements in the split output layout P x [B, T, Cp]."""
    b = tl.program_id(2)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    split = (c // CP)[None, :] * (tl.num_programs(2) * T * CP) + (b * T + t)[:, None] * CP + (c % CP)[None, :]
    return b, t, c, (t < T)[:, None] & (c < C)[None, :], split


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, T, C, CP, sxb, sxt, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """y (P x [B, T, Cp] in one buffer) = SiLU(z) for one [BT, BC] tile of batch row b."""
    b, t, c, mask, split = _tile(T, C, CP, BT, BC)
    z = _conv_z(x_ptr, w_ptr, b, t, c, T, C, sxb, sxt, W, BT, BC)
    tl.store(y_ptr + split, (z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_dz_kernel(x_ptr, w_ptr, dy_ptr, dz_ptr, T, C, CP, c_first, sxb, sxt, W: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    """dz [B, T, C] fp32 = dy * SiLU'(z) for one part's channels [c_first, c_first + Cp), with z
    recomputed; dy_ptr is that part's [B, T, Cp] gradient (one launch per part: nothing is stacked)."""
    b = tl.program_id(2)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    cp = tl.program_id(0) * BC + tl.arange(0, BC)  # channels within the part
    mask = (t < T)[:, None] & (cp < CP)[None, :]
    c = c_first + cp
    z = _conv_z(x_ptr, w_ptr, b, t, c, T, c_first + CP, sxb, sxt, W, BT, BC)
    dy = tl.load(dy_ptr + (b * T + t)[:, None] * CP + cp[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(z)
    tl.store(dz_ptr + (b * T + t)[:, None] * C + c[None, :], dy * s * (1.0 + z * (1.0 - s)), mask=mask)


@triton.jit
def _conv_dx_kernel(x_ptr, w_ptr, dz_ptr, dx_ptr, dw_ptr, T, C, sxb, sxt, W: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    """dx for one [BT, BC] tile, and this tile's fp32 share of dweight [C, W] (row of dw_ptr)."""
    b, t, c, _, _ = _tile(T, C, C, BT, BC)
    cmask = c < C
    tmask = t < T
    dz = tl.load(dz_ptr + (b * T + t)[:, None] * C + c[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0)
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    row = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # this tile's row of dw_ptr
    for w in tl.static_range(W):
        dst = t + (W - 1) - w  # output rows that read x[t] through tap w
        dzw = tl.load(dz_ptr + (b * T + dst)[:, None] * C + c[None, :], mask=(dst < T)[:, None] & cmask[None, :],
                      other=0.0)
        wt = tl.load(w_ptr + c * W + w, mask=cmask, other=0.0).to(tl.float32)
        dx += dzw * wt[None, :]
        src = t - (W - 1) + w  # the x row tap w multiplies into z[t]
        xw = tl.load(x_ptr + b * sxb + src[:, None] * sxt + c[None, :],
                     mask=((src >= 0) & tmask)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        tl.store(dw_ptr + row * C * W + c * W + w, tl.sum(dz * xw, axis=0), mask=cmask)
    tl.store(dx_ptr + (b * T + t)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def _grid(B: int, T: int, C: int) -> tuple[int, int, int]:
    """(channel blocks, time blocks, batch): the launch grid of every kernel here (see BT / BC)."""
    return triton.cdiv(C, BC), triton.cdiv(T, BT), B


class _ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, parts: int):
        B, T, C = x.shape
        w = weight.reshape(C, -1).to(x.dtype).contiguous()
        if x.stride(2) != 1:
            x = x.contiguous()
        y = torch.empty(parts, B, T, C // parts, device=x.device, dtype=x.dtype)
        grid = _grid(B, T, C)
        _conv_fwd_kernel[grid](x, w, y, T, C, C // parts, x.stride(0), x.stride(1), W=w.shape[1], BT=BT, BC=BC)
        ctx.save_for_backward(x, w)
        ctx.weight_meta = (weight.shape, weight.dtype)
        return tuple(y.unbind(0))

    @staticmethod
    def backward(ctx, *dys: Tensor):
        x, w = ctx.saved_tensors
        B, T, C = x.shape
        parts, W = len(dys), w.shape[1]
        cp = C // parts
        dz = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
        for p, dy in enumerate(dys):  # autograd materialises a zero gradient for an unused part
            _conv_dz_kernel[_grid(B, T, cp)](
                x, w, dy.contiguous(), dz, T, C, cp, p * cp, x.stride(0), x.stride(1), W=W, BT=BT, BC=BC)
        grid = _grid(B, T, C)
        dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
        dw_part = torch.empty(B * grid[1], C, W, device=x.device, dtype=torch.float32)
        _conv_dx_kernel[grid](x, w, dz, dx, dw_part, T, C, x.stride(0), x.stride(1), W=W, BT=BT, BC=BC)
        shape, dtype = ctx.weight_meta
        return dx, dw_part.sum(0).reshape(shape).to(dtype), None


def causal_conv_silu(x: Tensor, weight: Tensor, parts: int = 1) -> tuple[Tensor, ...]:
    """SiLU(causal depthwise conv(x)) split into `parts` contiguous tensors (module docstring).

    Args:
        x: [B, T, C] with unit channel stride (a slice of a wider tensor is fine).
        weight: [C, 1, W] (nn.Conv1d's layout) or [C, W]; parts: C must divide into it.
    Returns:
        `parts` tensors [B, T, C / parts] in x's dtype.
    """
    if x.dim() != 3 or weight.numel() % x.shape[-1] or x.shape[-1] % parts:
        raise ValueError(f"causal_conv_silu: x {tuple(x.shape)} must be [B, T, C] with weight {tuple(weight.shape)} "
                         f"= [C, 1, W] and C divisible by parts={parts}")
    return _ShortConvFunction.apply(x, weight, parts)
