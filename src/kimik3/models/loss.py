"""Next-token cross-entropy (+ z-loss) through the LM head, its gradient formed in the forward pass.

Shapes: N tokens, D hidden, V vocab.

Tokens are processed in chunks of about `_LOGIT_CHUNK_ELEMS / V`, so only one chunk of logits exists
at a time (at V = 163840 a chunk is ~400 tokens and its fp32 logits take 256 MiB, instead of
N * V * 4 bytes: 5 GiB at N = 8192). For each chunk, in the forward:

    logits = h W^T (in the autocast dtype)
    p = softmax(logits), lse = logsumexp(logits)                          (fp32 arithmetic)
    dlogits = (p (1 + 2 z_weight lse) - onehot(target)) / n_valid      (0 for ignored targets)
    dh = dlogits W,  dW += dlogits^T h

and the backward only scales the stored dh and dW by the incoming gradient. Why: the earlier form
checkpointed each chunk, so the backward ran the head matmul again (4 GEMMs where 3 do) and autograd
moved the fp32 logits through memory about twice as often; that loss took 17 ms of a 263 ms
kda_dense_1b training step at T=8192 on the H200. The cost: dW (fp32, [V, D]) exists from the forward
on, where autograd would allocate the head's gradient at the start of the backward.

On CUDA the softmax and dlogits lines are one Triton kernel per chunk (ops/cross_entropy.py) that
writes dlogits over the logits; elsewhere (and for an fp64 head) eager PyTorch on an fp32 copy.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
_LOGIT_CHUNK_ELEMS = 1 << 26


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head matmul runs in: autocast's when it is on for this device (as F.linear would)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _eager_rows(logits: Tensor, targets: Tensor, valid: Tensor, count: Tensor, z_weight: float, acc: torch.dtype,
                want_grad: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(lse [n], target logit [n], gradient [n, V] in the logits' dtype or None) of one chunk, as
    ops/cross_entropy.xent_rows computes them, in eager PyTorch (any device, fp64 too)."""
    dtype = logits.dtype
    logits = logits.to(acc)
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = torch.where(valid, logits.gather(1, targets.clamp_min(0)[:, None]).squeeze(1), 0.0)
    if not want_grad:
        return lse, target_logit, None
    # in place over the fp32 logits: p (1 + 2 z_weight lse) - onehot, zero rows for ignored targets
    probs = logits.sub_(lse[:, None]).exp_()
    probs.mul_(torch.where(valid, 1.0 + 2.0 * z_weight * lse, 0.0)[:, None])
    probs.scatter_add_(1, targets.clamp_min(0)[:, None], -valid.to(acc)[:, None])
    return lse, target_logit, probs.div_(count).to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, z_weight: float, grad_hidden: bool,
                grad_weight: bool, fused: bool):
        N, V = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 stays)
        dt = _compute_dtype(hidden, weight)
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp_min(1)
        w = weight.to(dt)
        d_hidden = torch.empty_like(hidden) if grad_hidden else None
        d_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if grad_weight else None
        ce_sum = z_sum = hidden.new_zeros((), dtype=acc)
        chunk = max(1, _LOGIT_CHUNK_ELEMS // V)
        want_grad = grad_hidden or grad_weight
        if fused:
            from kimik3.ops.cross_entropy import xent_rows  # imports Triton (the [gpu] extra)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, N, chunk):
                end = min(N, start + chunk)
                h, t, ok = hidden[start:end].to(dt), targets[start:end], valid[start:end]
                logits = torch.mm(h, w.T)
                if fused:  # the gradient is written over the logits
                    lse, target_logit = xent_rows(logits, t, count, z_weight, IGNORE_INDEX, want_grad)
                    d_logits = logits
                else:
                    lse, target_logit, d_logits = _eager_rows(logits, t, ok, count, z_weight, acc, want_grad)
                del logits
                ce_sum = ce_sum + torch.where(ok, lse - target_logit, 0.0).sum()
                z_sum = z_sum + torch.where(ok, lse.square(), 0.0).sum()
                if grad_hidden:
                    d_hidden[start:end] = torch.mm(d_logits, w)
                if grad_weight:
                    d_weight += torch.mm(d_logits.T, h)
        ce, z = ce_sum / count, z_sum / count
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.mark_non_differentiable(ce, z)
        return ce + z_weight * z, ce, z

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss: Tensor, _g_ce: Tensor, _g_z: Tensor):
        d_hidden, d_weight = ctx.saved_tensors
        d_h = d_hidden * g_loss if d_hidden is not None else None
        d_w = d_weight * g_loss if d_weight is not None else None
        return d_h, d_w, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, z_weight: float = 0.0,
                         fused: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Mean next-token CE plus z_weight times the mean z-loss term (log-sum-exp squared), over
    non-ignored targets, with the head matmul folded in (module docstring).

    Args:
        hidden: [N, D] final hidden states; weight: [V, D] head weight; targets: [N] int64
            (IGNORE_INDEX = -100 is skipped); z_weight: the z-loss weight; fused: each chunk's
            softmax and gradient in ops/cross_entropy's Triton kernel (default: on CUDA, unless the
            head runs in fp64), else in eager PyTorch.
    Returns:
        (loss, ce, z): loss = ce + z_weight * z carries the gradient; ce and z are its two terms,
        without gradient. Scalars in fp32 (fp64 for an fp64 model).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"targets {tuple(targets.shape)} must be [N, D], [V, D] and [N]")
    grad = torch.is_grad_enabled()
    if fused is None:
        fused = hidden.is_cuda and _compute_dtype(hidden, weight) != torch.float64
    return _LinearCrossEntropy.apply(hidden, weight, targets, z_weight, grad and hidden.requires_grad,
                                     grad and weight.requires_grad, fused)
