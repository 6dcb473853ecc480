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
fp32, z rounded to x's dtype (the conv output), SiLU in fp32 rounded to x's dtype.

The backward is two kernels. `_conv_dz_kernel` (one persistent launch per part: autograd hands q, k
and v's gradients over separately) recomputes z from the W shifted x tiles, writes dz = dy * SiLU'(z)
in x's dtype (the dtype autograd gives the gradient of the conv's output), and multiplies the same
x tiles by dz for dweight[c, w] = sum over b, t of dz[b, t, c] * x[b, t - (W-1) + w, c], summed
elementwise per tap across the program's tiles and over rows once at the end. `_conv_dx_kernel` then
streams dz: dx[t] = sum_w dz[t + (W-1) - w] * weight[c, w]. HBM sees dy and x read once, dz written
and read once, dx written once.

Measured (benchmarks/HISTORY.md, "Memory-bound ops"): 0.438 ms per kda_dense_1b layer at T=8192 on
an H100 against a 0.1 ms floor. The backward before wrote an fp32 dz and read it back in a kernel that
also re-read x and took four row sums per tile for dweight: 0.622 ms. One kernel keeping dz in an
L2-resident scratch was correct but no faster than that (latency-bound); one recomputing dz for each
tap (W^2 + W loads of x per tile) took twice as long.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops import SHORT_CONV_MAX_TAPS
from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()  # the backward's runtime loop bounds under TRITON_INTERPRET=1 (CPU tests)

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
def _conv_dz_kernel(x_ptr, w_ptr, dy_ptr, dz_ptr, dw_ptr, T, C, CP, c_first, tiles, sxb, sxt, W: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    """dz = dy * SiLU'(z) ([B, T, C] in x's dtype) for BC channels [c_first + pid0 * BC, ...) of one part,
    whose gradient dy_ptr is [B, T, Cp], and this program's fp32 share of dweight for them (row pid1
    of dw_ptr). The program walks time tiles pid1, pid1 + n1, ... of all batch rows (`tiles` of them).

    The W shifted x tiles that make z are the ones dweight multiplies dz by, so they are loaded once
    for both; dweight's products accumulate elementwise per tap across the tiles and are summed over
    rows once, at the end (a row sum per tile and tap costs ~110 registers per thread on sm_90).
    W <= ops.SHORT_CONV_MAX_TAPS."""
    cp = tl.program_id(0) * BC + tl.arange(0, BC)
    c = c_first + cp
    cmask = cp < CP
    w0 = tl.load(w_ptr + c * W, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * W + 1, mask=cmask & (W > 1), other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * W + 2, mask=cmask & (W > 2), other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * W + 3, mask=cmask & (W > 3), other=0.0).to(tl.float32)
    acc0 = tl.zeros([BT, BC], dtype=tl.float32)  # sum over tiles of dz[t] * x[t - (W-1) + tap], tap 0..3
    acc1 = tl.zeros([BT, BC], dtype=tl.float32)
    acc2 = tl.zeros([BT, BC], dtype=tl.float32)
    acc3 = tl.zeros([BT, BC], dtype=tl.float32)
    per_row = tl.cdiv(T, BT)
    for tile in range(tl.program_id(1), tiles, tl.num_programs(1)):
        b = tile // per_row
        t = (tile % per_row) * BT + tl.arange(0, BT)
        tmask = (t < T)[:, None] & cmask[None, :]
        x_rows = x_ptr + b * sxb + c[None, :]
        # tap w reads x[t - (W-1) + w]; taps past W read nothing (masked to 0)
        x0 = tl.load(x_rows + (t - (W - 1))[:, None] * sxt, mask=(t >= W - 1)[:, None] & tmask, other=0.0)
        x1 = tl.load(x_rows + (t - (W - 2))[:, None] * sxt, mask=((t >= W - 2) & (W > 1))[:, None] & tmask, other=0.0)
        x2 = tl.load(x_rows + (t - (W - 3))[:, None] * sxt, mask=((t >= W - 3) & (W > 2))[:, None] & tmask, other=0.0)
        x3 = tl.load(x_rows + (t - (W - 4))[:, None] * sxt, mask=((t >= W - 4) & (W > 3))[:, None] & tmask, other=0.0)
        z = (x0.to(tl.float32) * w0[None, :] + x1.to(tl.float32) * w1[None, :] + x2.to(tl.float32) * w2[None, :]
             + x3.to(tl.float32) * w3[None, :])
        z = z.to(x_ptr.dtype.element_ty).to(tl.float32)  # the conv output, rounded as eagerly
        dy = tl.load(dy_ptr + (b * T + t)[:, None] * CP + cp[None, :], mask=tmask, other=0.0).to(tl.float32)
        s = tl.sigmoid(z)
        # rounded to x's dtype, as autograd hands the conv the gradient of its (x-dtype) output
        dz = (dy * s * (1.0 + z * (1.0 - s))).to(dz_ptr.dtype.element_ty)
        tl.store(dz_ptr + (b * T + t)[:, None] * C + c[None, :], dz, mask=tmask)
        dzf = dz.to(tl.float32)
        acc0 += dzf * x0.to(tl.float32)
        acc1 += dzf * x1.to(tl.float32)
        acc2 += dzf * x2.to(tl.float32)
        acc3 += dzf * x3.to(tl.float32)
    part = dw_ptr + (tl.program_id(1) * C + c) * W  # this program's row of dweight partial sums
    tl.store(part, tl.sum(acc0, axis=0), mask=cmask)
    tl.store(part + 1, tl.sum(acc1, axis=0), mask=cmask & (W > 1))
    tl.store(part + 2, tl.sum(acc2, axis=0), mask=cmask & (W > 2))
    tl.store(part + 3, tl.sum(acc3, axis=0), mask=cmask & (W > 3))


@triton.jit
def _conv_dx_kernel(w_ptr, dz_ptr, dx_ptr, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx[t] = sum_w dz[t + (W-1) - w] * weight[c, w] for one [BT, BC] tile: the output rows that
    read x[t] through each tap. Streams dz once (the shifted re-reads hit in cache) and writes dx."""
    b, t, c, mask, _ = _tile(T, C, C, BT, BC)
    cmask = c < C
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for w in tl.static_range(W):
        dst = t + (W - 1) - w
        dzw = tl.load(dz_ptr + (b * T + dst)[:, None] * C + c[None, :], mask=(dst < T)[:, None] & cmask[None, :],
                      other=0.0)
        wt = tl.load(w_ptr + c * W + w, mask=cmask, other=0.0).to(tl.float32)
        dx += dzw.to(tl.float32) * wt[None, :]
    tl.store(dx_ptr + (b * T + t)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


DZ_BT, DZ_BC, DZ_WARPS = 16, 64, 4
"""_conv_dz_kernel's tile (time rows x channels) and warps: 128 registers on sm_90 without spills
(`python -m kimik3.ops.triton_aot`). The fastest of nine tiles timed on an H100 at kda_dense_1b's
T=8192 (0.416 ms per backward; 32 x 32 on 4 warps equal, 32 x 64 on 8 warps 0.438, 64-row or 128-wide
tiles 0.54-0.56; benchmarks/HISTORY.md), with the same errors against fp32 eager as the others."""


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
        blocks, tiles = triton.cdiv(cp, DZ_BC), B * triton.cdiv(T, DZ_BT)
        walkers = max(1, min(tiles, _programs_in_flight(x.device) // blocks))
        dz = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
        dw_part = torch.empty(walkers, C, W, device=x.device, dtype=torch.float32)
        for p, dy in enumerate(dys):  # autograd materialises a zero gradient for an unused part
            _conv_dz_kernel[(blocks, walkers)](
                x, w, dy.contiguous(), dz, dw_part, T, C, cp, p * cp, tiles, x.stride(0), x.stride(1),
                W=W, BT=DZ_BT, BC=DZ_BC, num_warps=DZ_WARPS)
        dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
        _conv_dx_kernel[_grid(B, T, C)](w, dz, dx, T, C, W=W, BT=BT, BC=BC)
        shape, dtype = ctx.weight_meta
        return dx, dw_part.sum(0).reshape(shape).to(dtype), None


@functools.cache
def _programs_in_flight(device: torch.device) -> int:
    """Programs of _conv_dz_kernel's persistent grid: 4 per SM (each walks many tiles, so its dweight
    partial sums are few); 8 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def causal_conv_silu(x: Tensor, weight: Tensor, parts: int = 1) -> tuple[Tensor, ...]:
    """SiLU(causal depthwise conv(x)) split into `parts` contiguous tensors (module docstring).

    Args:
        x: [B, T, C] with unit channel stride (a slice of a wider tensor is fine).
        weight: [C, 1, W] (nn.Conv1d's layout) or [C, W]; parts: C must divide into it.
    Returns:
        `parts` tensors [B, T, C / parts] in x's dtype.
    """
    if x.dim() == 3 and weight.numel() > SHORT_CONV_MAX_TAPS * x.shape[-1]:
        raise ValueError(f"causal_conv_silu takes kernels of at most {SHORT_CONV_MAX_TAPS} taps, got weight {tuple(weight.shape)} "
                         f"for {x.shape[-1]} channels")
    if x.dim() != 3 or weight.numel() % x.shape[-1] or x.shape[-1] % parts:
        raise ValueError(f"causal_conv_silu: x {tuple(x.shape)} must be [B, T, C] with weight {tuple(weight.shape)} "
                         f"= [C, 1, W] and C divisible by parts={parts}")
    return _ShortConvFunction.apply(x, weight, parts)
