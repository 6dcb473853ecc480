"""AdamW over a list of fp32 tensors in one Triton launch that reads each gradient and never writes it.

Why: torch's fused AdamW, given the clip factor as `grad_scale`, stores the rescaled gradient back
(a store meant for GradScaler), so each element costs 32 bytes of traffic (p, g, m, v read; p, g, m,
v written). This kernel moves 28 (g is only read) and multiplies by the clip factor c directly, as
clipping in place would. On `kimi_3b_a1b` (2.96B parameters, all AdamW in the benchmark recipe) the
optimizer is ~10% of the step's device time and purely bandwidth-bound. One launch covers every
tensor (as torch's multi-tensor kernels do), so the host issues one kernel however many tensors there
are: that MoE step's host barely keeps ahead of its GPU.

How one launch finds its tensors: each program handles a span of one tensor. A block map
(which tensor each program works on, cached per list of sizes) and a per-call table of element
offsets of p, g, m, v and the step count, relative to the first parameter, are read at the program's
start. The offsets are multiples of 4 elements (torch's allocations are 512-byte aligned), which the
kernel states, so its loads stay 16 bytes wide. The table goes to the device from pinned memory
without waiting for the queue (the caching host allocator keeps the buffer until the copy is done).

The math is torch.optim.AdamW's (decoupled weight decay, bias corrections from the step count):
    p <- p (1 - lr wd)
    m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
in fp32, with g = c * grad when clipping. t is read on the device (each tensor's fp32 step count,
already incremented), and a set `skip` flag returns before anything is read, so neither needs a host
sync. 1 - b1 and 1 - b2 come from the host (formed in fp64, as torch forms them), and the bias
corrections are formed in fp64 from them once per program (`_bias_corrections` says why). Results
agree with torch's kernels to fp32 rounding (torch forms lr * wd in fp64, here it is fp32):
tests/ops/test_adamw.py.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096
"""Elements per block: 16 KiB of each of p, g, m and v."""

_BLOCKS_PER_PROGRAM = 4
"""Blocks one program updates in turn (its span: 16384 elements)."""

_ALIGN = 4
"""Every tensor's offset from the first parameter is a multiple of this many fp32 elements (16 bytes)."""


@triton.jit
def _bias_corrections(step, lr, c1, c2):
    """(lr / (1 - beta1^t), sqrt(1 - beta2^t)) in fp32 for the step count t, from c = 1 - beta (as the
    moments use it), formed in fp64 as torch forms them. Why: 1 - beta^t cancels. Formed in fp32, the
    rounding of beta^t alone (3e-8; the GPU's approximate exp2 adds more) was 3e-4 of 1 - beta^t at
    beta = 0.9999, t = 1, and the first updates were off by 8e-5 (7e-6 at beta2 = 0.999; interpreter)
    where torch's are right to fp32 rounding. Scalars, once per program."""
    t = step.to(tl.float64)
    bias1 = 1.0 - tl.exp2(t * tl.log2(1.0 - tl.cast(c1, tl.float64)))
    bias2 = 1.0 - tl.exp2(t * tl.log2(1.0 - tl.cast(c2, tl.float64)))
    return (tl.cast(lr, tl.float64) / bias1).to(tl.float32), tl.sqrt(bias2).to(tl.float32)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, mask, clip_ptr, step_size, bias2_sqrt, decay, beta1, beta2, c1, c2,
                 eps, HAS_CLIP: tl.constexpr, MASKED: tl.constexpr):
    """One block's update; MASKED only on a tensor's last, partial block, so full blocks keep their
    loads 16 bytes wide (a mask by a size read from memory would make every load scalar)."""
    if MASKED:
        g = tl.load(g_ptr, mask=mask)
        m = tl.load(m_ptr, mask=mask)
        v = tl.load(v_ptr, mask=mask)
        p = tl.load(p_ptr, mask=mask)
    else:
        g = tl.load(g_ptr)
        m = tl.load(m_ptr)
        v = tl.load(v_ptr)
        p = tl.load(p_ptr)
    if HAS_CLIP:
        g = g * tl.load(clip_ptr)
    m = beta1 * m + c1 * g
    v = beta2 * v + c2 * g * g
    p = p * decay - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if MASKED:
        tl.store(m_ptr, m, mask=mask)
        tl.store(v_ptr, v, mask=mask)
        tl.store(p_ptr, p, mask=mask)
    else:
        tl.store(m_ptr, m)
        tl.store(v_ptr, v)
        tl.store(p_ptr, p)


@triton.jit
def _adamw_kernel(base_ptr, offsets_ptr, block_tensor_ptr, first_block_ptr, numel_ptr, clip_ptr, skip_ptr,
                  lr, decay, beta1, beta2, c1, c2, eps, HAS_CLIP: tl.constexpr, HAS_SKIP: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, ALIGN: tl.constexpr):
    """offsets: [tensors, 5] int64 element offsets of (p, g, m, v, step) from base_ptr; block_tensor:
    the tensor of each program; first_block: each tensor's first program; decay = 1 - lr * wd;
    c1, c2 = 1 - beta1, 1 - beta2 (from the host: 1 - fl32(0.9999) is 1.7e-4 off 1 - 0.9999). A
    program updates BLOCKS_PER_PROGRAM blocks in turn, so its table reads (dependent loads before
    any data moves) are paid once per 64 KiB of each array."""
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = (pid - tl.load(first_block_ptr + t)).to(tl.int64) * (BLOCK * BLOCKS_PER_PROGRAM)
    n = tl.load(numel_ptr + t)
    row = offsets_ptr + t.to(tl.int64) * 5
    p_ptr = base_ptr + tl.multiple_of(tl.load(row), ALIGN)
    g_ptr = base_ptr + tl.multiple_of(tl.load(row + 1), ALIGN)
    m_ptr = base_ptr + tl.multiple_of(tl.load(row + 2), ALIGN)
    v_ptr = base_ptr + tl.multiple_of(tl.load(row + 3), ALIGN)
    step_size, bias2_sqrt = _bias_corrections(tl.load(base_ptr + tl.load(row + 4)), lr, c1, c2)
    for b in tl.static_range(BLOCKS_PER_PROGRAM):
        offs = start + b * BLOCK + tl.arange(0, BLOCK)
        if start + (b + 1) * BLOCK <= n:
            _adamw_block(p_ptr + offs, g_ptr + offs, m_ptr + offs, v_ptr + offs, offs < n, clip_ptr, step_size,
                         bias2_sqrt, decay, beta1, beta2, c1, c2, eps, HAS_CLIP, False)
        elif start + b * BLOCK < n:
            _adamw_block(p_ptr + offs, g_ptr + offs, m_ptr + offs, v_ptr + offs, offs < n, clip_ptr, step_size,
                         bias2_sqrt, decay, beta1, beta2, c1, c2, eps, HAS_CLIP, True)


@lru_cache(maxsize=8)
def _block_map(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(block_tensor, first_block, numel) on `device` for tensors of these sizes; built once per list
    of sizes (an optimizer's large tensors do not change between steps)."""
    blocks = torch.tensor([triton.cdiv(n, _BLOCK * _BLOCKS_PER_PROGRAM) for n in numels])
    first = torch.cumsum(blocks, 0) - blocks
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    return (block_tensor.to(device), first.to(torch.int32).to(device),
            torch.tensor(numels, dtype=torch.int64).to(device))


def _offsets_table(base: Tensor, rows: Sequence[Sequence[Tensor]]) -> Tensor:
    """[len(rows), 5] int64 element offsets of each row's tensors from `base`, on base's device."""
    start, size = base.data_ptr(), base.element_size()
    table = torch.tensor([[(t.data_ptr() - start) // size for t in row] for row in rows], dtype=torch.int64,
                         pin_memory=base.is_cuda)
    return table.to(base.device, non_blocking=True)


def row_problem(row: Sequence[Tensor], device: torch.device, index: int = 0) -> Optional[str]:
    """What keeps one (param, grad, exp_avg, exp_avg_sq, step) row out of the kernel, or None: the four
    dense tensors must be contiguous fp32 of the param's shape on `device` at 16-byte-aligned
    addresses, the step an fp32 tensor there. The one statement of what the kernel accepts, for
    adamw_update_'s refusals and optim.muon's routing alike."""
    param, *dense, step = row
    for name, t in zip(("param", "grad", "exp_avg", "exp_avg_sq"), (param, *dense)):
        if (t.dtype != torch.float32 or not t.is_contiguous() or t.shape != param.shape or t.device != device
                or t.data_ptr() % 16):
            return (f"{name} {index} must be a contiguous, 16-byte-aligned fp32 tensor of shape "
                    f"{tuple(param.shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device} "
                    f"(contiguous={t.is_contiguous()})")
    if step.dtype != torch.float32 or step.device != device:
        return f"step {index} must be an fp32 tensor on {device}, got {step.dtype} on {step.device}"
    return None


def adamw_update_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                  exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float, weight_decay: float,
                  beta1: float, beta2: float, eps: float, clip_coef: Optional[Tensor] = None,
                  skip: Optional[Tensor] = None) -> None:
    """Update every param, exp_avg and exp_avg_sq in place (module docstring), in one launch; grads are
    only read.

    Per index: param, grad, exp_avg, exp_avg_sq fp32, contiguous, one shape, on one device, each at a
    16-byte-aligned address; step the 0-dim fp32 step count after this step's increment. clip_coef:
    0-dim fp32 factor c (g * c is the gradient used); skip: 0-dim bool, when True nothing is read or
    written (a NaN c or gradient then never leaks)."""
    if not params:
        return
    rows = list(zip(params, grads, exp_avgs, exp_avg_sqs, steps))
    base = params[0]
    for i, row in enumerate(rows):
        problem = row_problem(row, base.device, i)
        if problem is not None:
            raise ValueError(f"adamw_update_: {problem}")
    block_tensor, first_block, numel = _block_map(tuple(p.numel() for p in params), base.device)
    _adamw_kernel[(block_tensor.numel(),)](
        base, _offsets_table(base, rows), block_tensor, first_block, numel,
        clip_coef if clip_coef is not None else base, skip if skip is not None else base,
        lr, 1.0 - lr * weight_decay, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps,
        HAS_CLIP=clip_coef is not None, HAS_SKIP=skip is not None, BLOCK=_BLOCK,
        BLOCKS_PER_PROGRAM=_BLOCKS_PER_PROGRAM, ALIGN=_ALIGN, num_warps=8,
    )
