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

The backward is one persistent kernel per part (q, k, v: autograd hands their gradients over
separately). Each program walks time tiles of one channel block, recomputes z and dz = dy *
SiLU'(z) for the tile and the W - 1 rows after it, and reads dz back shifted from a small fp32
scratch slot of its own (L2-resident) for dx[t] = sum_w dz[t + (W-1) - w] * weight[c, w];
dweight[c, w] = sum over b, t of dz[b, t, c] * x[b, t - (W-1) + w, c] accumulates in registers and
is written once per program, then summed. HBM sees dy and x read once and dx written once. The
previous backward stored dz in fp32 ([B, T, C], 200 MB per kda_dense_1b layer at T=8192) and read
it back in a second kernel; a single kernel that recomputed dz for each tap instead (W^2 + W loads
of x per tile) took 14.7 ms per kda_dense_1b training step at T=8192 on the H200, against 7.0 ms for
that second kernel.
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
def _conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, scratch_ptr, T, C, CP, c_first, tiles, sxb, sxt,
                     W: tl.constexpr, HALO: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx and this program's fp32 share of dweight for BC channels [c_first + pid0 * BC, ...) of one
    part, whose gradient dy_ptr is [B, T, Cp]; the program walks time tiles pid1, pid1 + n1, ... of
    all batch rows (`tiles` = B * ceil(T / BT) of them). W <= ops.SHORT_CONV_MAX_TAPS.

    Per tile it recomputes z for its BT rows and the HALO rows after them, forms dz = dy * SiLU'(z)
    there and parks it in its own slot of `scratch_ptr` (2 x [BT + HALO, BC] fp32, written and read
    back by this program only, so it stays in L2), then reads dz back at the W shifts dx needs: dz
    never makes a round trip through HBM. dweight's products accumulate elementwise per tap across
    the tiles and are summed over rows once, at the end (a row sum per tile and tap cost ~110
    registers per thread on sm_90)."""
    cp = tl.program_id(0) * BC + tl.arange(0, BC)
    c = c_first + cp
    cmask = cp < CP
    c_end = c_first + CP
    slot = scratch_ptr + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * 2 * (BT + HALO) * BC
    cols = tl.arange(0, BC)
    rows = tl.arange(0, BT)
    halo = tl.arange(0, HALO)
    acc0 = tl.zeros([BT, BC], dtype=tl.float32)  # sum over tiles of dz[t] * x[t - (W-1) + tap], tap 0..3
    acc1 = tl.zeros([BT, BC], dtype=tl.float32)
    acc2 = tl.zeros([BT, BC], dtype=tl.float32)
    acc3 = tl.zeros([BT, BC], dtype=tl.float32)
    per_row = tl.cdiv(T, BT)
    for tile in range(tl.program_id(1), tiles, tl.num_programs(1)):
        base = ((tile - tl.program_id(1)) // tl.num_programs(1)) % 2 * (BT + HALO)  # the slot half of this tile
        b = tile // per_row
        t0 = (tile % per_row) * BT
        t = t0 + rows
        th = t0 + BT + halo
        tmask = (t < T)[:, None] & cmask[None, :]
        hmask = (th < T)[:, None] & cmask[None, :]
        z = _conv_z(x_ptr, w_ptr, b, t, c, T, c_end, sxb, sxt, W, BT, BC)
        dy = tl.load(dy_ptr + (b * T + t)[:, None] * CP + cp[None, :], mask=tmask, other=0.0).to(tl.float32)
        s = tl.sigmoid(z)
        dz = dy * s * (1.0 + z * (1.0 - s))  # 0 past T (masked dy)
        zh = _conv_z(x_ptr, w_ptr, b, th, c, T, c_end, sxb, sxt, W, HALO, BC)
        dyh = tl.load(dy_ptr + (b * T + th)[:, None] * CP + cp[None, :], mask=hmask, other=0.0).to(tl.float32)
        sh = tl.sigmoid(zh)
        tl.store(slot + (base + rows)[:, None] * BC + cols[None, :], dz)
        tl.store(slot + (base + BT + halo)[:, None] * BC + cols[None, :], dyh * sh * (1.0 + zh * (1.0 - sh)))
        # The half is written before any thread reads it shifted. The halves alternate, so one barrier
        # per tile suffices: a thread comes back to this half two tiles on, past the next tile's
        # barrier, which every thread reaches only after its reads of this one.
        tl.debug_barrier()
        dx = tl.zeros([BT, BC], dtype=tl.float32)
        for w in tl.static_range(W):
            # output rows t + (W-1) - w read x[t] through tap w
            dzw = tl.load(slot + (base + rows + (W - 1) - w)[:, None] * BC + cols[None, :])
            wt = tl.load(w_ptr + c * W + w, mask=cmask, other=0.0).to(tl.float32)
            dx += dzw * wt[None, :]
            src = t - (W - 1) + w  # the x row tap w multiplies into z[t]
            xw = tl.load(x_ptr + b * sxb + src[:, None] * sxt + c[None, :], mask=(src >= 0)[:, None] & tmask,
                         other=0.0).to(tl.float32)
            if w == 0:
                acc0 += dz * xw
            elif w == 1:
                acc1 += dz * xw
            elif w == 2:
                acc2 += dz * xw
            else:
                acc3 += dz * xw
        tl.store(dx_ptr + (b * T + t)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=tmask)
    part = dw_ptr + (tl.program_id(1) * C + c) * W  # this program's row of dweight partial sums
    tl.store(part, tl.sum(acc0, axis=0), mask=cmask)
    if W > 1:
        tl.store(part + 1, tl.sum(acc1, axis=0), mask=cmask)
    if W > 2:
        tl.store(part + 2, tl.sum(acc2, axis=0), mask=cmask)
    if W > 3:
        tl.store(part + 3, tl.sum(acc3, axis=0), mask=cmask)


BWD_BT, BWD_BC, BWD_WARPS = 16, 64, 4
"""The backward's tile (time rows x channels) and warps. At 16 x 64 on 4 warps it compiles to 128
registers on sm_90 (4 programs per SM); 32-row tiles took 255 (`python -m kimik3.ops.triton_aot`)."""


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
        blocks, tiles = triton.cdiv(cp, BWD_BC), B * triton.cdiv(T, BWD_BT)
        walkers = max(1, min(tiles, _programs_in_flight(x.device) // blocks))
        halo = triton.next_power_of_2(max(W - 1, 1))
        scratch = torch.empty(walkers * blocks * 2 * (BWD_BT + halo) * BWD_BC, device=x.device, dtype=torch.float32)
        dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
        dw_part = torch.empty(walkers, C, W, device=x.device, dtype=torch.float32)
        for p, dy in enumerate(dys):  # autograd materialises a zero gradient for an unused part
            _conv_bwd_kernel[(blocks, walkers)](
                x, w, dy.contiguous(), dx, dw_part, scratch, T, C, cp, p * cp, tiles, x.stride(0), x.stride(1),
                W=W, HALO=halo, BT=BWD_BT, BC=BWD_BC, num_warps=BWD_WARPS, num_stages=1)
        shape, dtype = ctx.weight_meta
        return dx, dw_part.sum(0).reshape(shape).to(dtype), None


@functools.cache
def _programs_in_flight(device: torch.device) -> int:
    """Programs of the backward's persistent grid: 4 per SM (what fits at its registers), so each
    scratch slot is one program's and all of them (~9 MB on an H100) stay in L2; 8 off CUDA (the
    interpreter)."""
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
