"""Per-row softmax statistics and the cross-entropy gradient of a chunk of logits, in one Triton kernel.

Shapes: n rows (tokens), V vocab. For logits [n, V] (the head matmul's output, in its compute dtype),
targets [n] and the number of counted targets `count` (a device scalar: reading it would sync):

    lse[r] = logsumexp(logits[r])                               fp32
    target_logit[r] = logits[r, targets[r]]                      fp32 (0 for an ignored target)
    grad[r] = (softmax(logits[r]) (1 + 2 z_weight lse[r]) - onehot(targets[r])) / count
              (a zero row for an ignored target), written over the logits in their dtype.

models/loss.py calls it on CUDA for each chunk of its fused head + loss. Why a kernel: the eager form
upcasts the chunk to fp32 and passes it through memory about a dozen times (upcast, logsumexp, sub,
exp, two scalings, downcast); here each row is read twice (online max/sum, then the gradient) and
written once, in its own dtype. Arithmetic is fp32 as in the eager form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _xent_rows_kernel(logits_ptr, targets_ptr, count_ptr, lse_ptr, target_logit_ptr, V, z_weight, ignore_index,
                      WRITE_GRAD: tl.constexpr, BV: tl.constexpr):
    """One row: lse and the target's logit; with WRITE_GRAD the gradient over the row."""
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + r * V
    cols = tl.arange(0, BV)
    # Online max / sum of exponentials per lane (a finite floor keeps padded lanes away from inf - inf).
    m = tl.full([BV], -1e30, dtype=tl.float32)
    s = tl.zeros([BV], dtype=tl.float32)
    for start in range(0, V, BV):
        x = tl.load(row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    target = tl.load(targets_ptr + r)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.where(valid, tl.load(row + safe_target).to(tl.float32), 0.0)
    tl.store(lse_ptr + r, lse)
    tl.store(target_logit_ptr + r, target_logit)
    if WRITE_GRAD:
        inv_count = tl.where(valid, 1.0 / tl.load(count_ptr).to(tl.float32), 0.0)
        scale = (1.0 + 2.0 * z_weight * lse) * inv_count
        for start in range(0, V, BV):
            idx = start + cols
            mask = idx < V
            x = tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) * scale - tl.where(idx == safe_target, inv_count, 0.0)
            tl.store(row + idx, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def xent_rows(logits: Tensor, targets: Tensor, count: Tensor, z_weight: float, ignore_index: int,
              write_grad: bool) -> tuple[Tensor, Tensor]:
    """(lse [n], target_logit [n]) in fp32; with write_grad the logits become the gradient (module
    docstring). logits: [n, V] contiguous; targets: [n] int64; count: a 0-dim device tensor."""
    n, V = logits.shape
    if not logits.is_contiguous() or targets.shape != (n,):
        raise ValueError(f"xent_rows: logits {tuple(logits.shape)} must be contiguous and targets "
                         f"{tuple(targets.shape)} must be [{n}]")
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    target_logit = torch.empty_like(lse)
    _xent_rows_kernel[(n,)](logits, targets, count, lse, target_logit, V, float(z_weight), ignore_index,
                            WRITE_GRAD=write_grad, BV=BLOCK_V, num_warps=NUM_WARPS)
    return lse, target_logit
