"""Muon (+ AdamW) as one torch optimizer: Newton-Schulz orthogonalised momentum for hidden matrices.

Muon (Jordan et al. 2024; "Muon is Scalable", Moonlight, arXiv:2502.16982) updates a weight matrix
W [A, B] (out, in) with the orthogonalised Nesterov momentum of its gradient:
    m   = mu * m + g                         (momentum buffer)
    u   = g + mu * m                         (Nesterov)
    O   = NewtonSchulz(u) ~ U V^T            (u = U S V^T; all singular values pushed to ~1)
    W  <- W * (1 - lr * wd) - lr * (rms_scale * sqrt(max(A, B))) * O
O has RMS ~ 1/sqrt(max(A, B)), so the update RMS is ~ rms_scale (0.2), the typical AdamW update RMS
(Moonlight Sec. 2.2): AdamW's lr and weight decay carry over unchanged. 3-D expert weights
[E, out, in] are E independent matrices. A block split orthogonalises equal row or column blocks
separately (A, B are then the block's sizes): the gate and up halves of a fused SwiGLU weight,
which are two matrices in the math, and, with `muon_per_head`, attention projections per head
(rows of q/k/v projections, columns of o_proj).

The AdamW groups use torch's own functional AdamW (fused on CUDA, foreach elsewhere), so they
match torch.optim.AdamW exactly, except that CUDA tensors of TRITON_ADAMW_MIN_NUMEL or more
elements take kimik3.ops.adamw's kernel (the same math to fp32 rounding, without the gradient
write-back that torch's fused kernel does when it applies the clip factor). One optimizer object
holds both kinds of group: one state_dict, one step (which takes the skip flag and the grad-clip
factor too), one zero_grad. Every group carries "base_lr" for the schedule.

Legend: A, B = rows (out) and columns (in) of a matrix; N = a batch of matrices (experts, heads).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam

from kimik3.distributed.full_matrices import on_full_matrices

# Quintic Newton-Schulz coefficients (Jordan et al.): x -> a x + b x^3 + c x^5 on singular values.
# They trade exactness for speed: 5 steps take every singular value in (0, 1] into roughly
# [0.68, 1.13] (tests/optim/test_muon.py measures the band) instead of converging to exactly 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

MUON_KEYS = ("momentum", "nesterov", "ns_steps", "rms_scale", "block_splits")
ADAMW_KEYS = ("betas", "eps")

TRITON_ADAMW_MIN_NUMEL = 1 << 20
"""CUDA AdamW tensors at least this large take ops.adamw's kernel; the smaller ones (kimi_3b_a1b: 248
of 464 tensors, 0.8% of the elements) stay in torch's fused AdamW, whose write-back costs little there
and which needs no alignment or size bookkeeping."""

BlockSplit = Optional[tuple[int, int]]
"""None (whole matrices) or (axis, parts): each matrix is orthogonalised as `parts` equal blocks of
rows (axis 0) or columns (axis 1): attention heads, or the gate and up halves of a fused SwiGLU."""


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximate orthogonal polar factor U V^T of each matrix of g [..., A, B].

    Runs in bf16 on CUDA (the iteration is robust to it and tensor cores make it cheap) and fp32
    elsewhere. Iterates on the smaller side: X X^T is [min(A,B), min(A,B)]. Normalising by the
    Frobenius norm first puts every singular value in (0, 1], inside the quintic's basin.
    Returns the compute dtype; the caller casts.
    """
    a, b, c = NS_COEFFS
    shape = g.shape
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32).reshape(-1, *shape[-2:])  # [N, A, B]
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT  # [N, min, min]
        poly = torch.baddbmm(s, s, s, beta=b, alpha=c)  # b S + c S^2, one fused GEMM
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b S + c S^2) X
    return (x.mT if transposed else x).reshape(shape)


def to_blocks(u: Tensor, split: BlockSplit) -> Tensor:
    """View an update [A, B] or [E, A, B] as a batch of matrices [N, a, b] (N = E * parts)."""
    mats = u.reshape(-1, *u.shape[-2:])  # [E, A, B]
    if split is None:
        return mats
    axis, parts = split
    E, A, B = mats.shape
    if axis == 0:
        return mats.reshape(E * parts, A // parts, B)
    return mats.reshape(E, A, parts, B // parts).transpose(1, 2).reshape(E * parts, A, B // parts)


def from_blocks(o: Tensor, split: BlockSplit, shape: torch.Size) -> Tensor:
    """Inverse of `to_blocks`: [N, a, b] back to the parameter's shape."""
    if split is None or split[0] == 0:
        return o.reshape(shape)
    parts, (A, B) = split[1], shape[-2:]
    return o.reshape(-1, parts, A, B // parts).transpose(1, 2).reshape(shape)


def check_block_split(shape: torch.Size, split: BlockSplit) -> None:
    """ValueError unless `split` divides the matrices of a parameter evenly along its axis."""
    if split is None:
        return
    axis, parts = split
    if axis not in (0, 1) or parts < 1 or shape[-2 + axis] % parts:
        raise ValueError(f"block split {split} (axis, parts) does not divide a parameter of shape {tuple(shape)}")


def orthogonalise(updates: list[Tensor], splits: list[BlockSplit], ns_steps: int) -> list[Tensor]:
    """Newton-Schulz each update's matrices, batching all blocks of one shape into one call.

    Same-shape matrices across layers (and all experts / heads) share one batched matmul chain,
    which is what keeps Muon's overhead small on a GPU.
    """
    blocks = [to_blocks(u, s) for u, s in zip(updates, splits)]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, blk in enumerate(blocks):
        by_shape.setdefault(tuple(blk.shape[-2:]), []).append(i)
    out: list[Optional[Tensor]] = [None] * len(blocks)
    for idx in by_shape.values():
        ortho = newton_schulz(torch.cat([blocks[i] for i in idx]), ns_steps)
        for i, o in zip(idx, ortho.split([blocks[i].shape[0] for i in idx])):
            out[i] = from_blocks(o, splits[i], updates[i].shape)
    return out  # type: ignore[return-value]


def rms_matching_scale(shape: torch.Size, split: BlockSplit, rms_scale: float) -> float:
    """rms_scale * sqrt(max(a, b)) for the a x b matrices Muon orthogonalises (blocks, when split)."""
    rows, cols = shape[-2], shape[-1]
    if split is not None:
        axis, parts = split
        rows, cols = (rows // parts, cols) if axis == 0 else (rows, cols // parts)
    return rms_scale * math.sqrt(max(rows, cols))


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over Muon groups (kind="muon") and AdamW groups (kind="adamw").

    Every group needs: params, kind, lr, base_lr, weight_decay, and
    - muon: momentum, nesterov, ns_steps, rms_scale, block_splits (one BlockSplit per param);
    - adamw: betas, eps.
    `kimik3.optim.build_optimizer` makes these groups from the name rules in `groups.py`.
    """

    def __init__(self, param_groups: Iterable[dict]) -> None:
        super().__init__(list(param_groups), defaults={})

    def add_param_group(self, param_group: dict) -> None:
        kind = param_group.get("kind")
        extra = {"muon": MUON_KEYS, "adamw": ADAMW_KEYS}.get(kind)
        if extra is None:
            raise ValueError(f"param group kind={kind!r} is not one of ['adamw', 'muon']")
        missing = [k for k in ("lr", "base_lr", "weight_decay", *extra) if k not in param_group]
        if missing:
            raise ValueError(f"{kind} param group {param_group.get('name')!r} lacks keys {missing}")
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if kind == "muon":
            if len(param_group["block_splits"]) != len(params):
                raise ValueError("muon param group: block_splits needs one entry per parameter")
            for p, split in zip(params, param_group["block_splits"]):
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D or 3-D [E, out, in] parameters, got shape {tuple(p.shape)}")
                check_block_split(p.shape, split)
        else:
            param_group.setdefault("fused", all(p.is_cuda for p in params))
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None, *, skip: Optional[Tensor] = None,  # noqa: ANN001 (torch's signature)
             clip_coef: Optional[Tensor] = None):
        """One update of every group.

        `skip`: a 0-dim bool tensor; when True the whole update is skipped on the device (parameters,
        momenta and step counts stay as they were, even with non-finite gradients), so the trainer's
        skip decision needs no host sync.

        `clip_coef`: a 0-dim fp32 tensor c on the parameters' device, 0 < c <= 1 (global-norm
        clipping's factor): the update is the one for the gradients times c, with no host sync and,
        for fused AdamW, no pass over the gradients of its own (see `_adamw_step`). It may be
        non-finite or 0 on a step that `skip` skips (the norm was inf or NaN); nothing leaks then.
        After an applied step p.grad holds its clipped gradient, as clipping in place left it (fused
        AdamW: g / (1/c), within an ulp or two of g * c), except on tensors that ops.adamw updates,
        which only read it: their p.grad is as it came. After a skipped step Muon's gradients are
        zeros and AdamW's are as they came. (Trainers zero them next anyway.)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group, skip, clip_coef)
            else:
                self._adamw_step(group, skip, clip_coef)
        return loss

    def _muon_step(self, group: dict, skip: Optional[Tensor], clip_coef: Optional[Tensor]) -> None:
        params, grads, bufs, splits = [], [], [], []
        for p, split in zip(group["params"], group["block_splits"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])
            splits.append(None if split is None else tuple(split))
        if not params:
            return
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        if clip_coef is not None:
            # Scaled in place, before they enter the momentum, with the very op clip_grads_with_norm_
            # uses: the same bits as clipping first. Before the skip mask, which zeroes a NaN product.
            torch._foreach_mul_(grads, clip_coef)
        keep = None
        if skip is not None:  # a skipped step: zero gradients (NaN-safe) and factors that change nothing
            keep = (~skip).to(params[0].dtype)
            for g in grads:
                g.masked_fill_(skip, 0.0)
            torch._foreach_mul_(bufs, torch.where(skip, 1.0, mu).to(bufs[0].dtype))
        else:
            torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        updates = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
        # FSDP2 hook (kimik3.distributed): sharded updates are orthogonalised as whole matrices.
        ortho = on_full_matrices(lambda us: orthogonalise(us, splits, group["ns_steps"]), updates)
        steps = [
            (-lr * rms_matching_scale(p.shape, s, group["rms_scale"]), o.to(p.dtype))
            for p, s, o in zip(params, splits, ortho)
        ]
        if keep is not None:
            torch._foreach_mul_([o for _, o in steps], keep)
        if wd != 0:
            torch._foreach_mul_(params, 1.0 - lr * wd if keep is None else 1.0 - lr * wd * keep)
        for p, (alpha, o) in zip(params, steps):
            p.add_(o, alpha=alpha)

    def _adamw_step(self, group: dict, skip: Optional[Tensor], clip_coef: Optional[Tensor]) -> None:
        """torch's functional AdamW over the group (fused: one kernel; foreach elsewhere), except the
        tensors `takes_triton_adamw` picks, which ops.adamw updates (one kernel for all of them, g * c
        read and never written back).

        Clipping, fused: the kernel takes grad_scale = 1/c and divides each gradient by it as it
        loads it. It also stores the quotient back to p.grad (a store meant for GradScaler's
        unscale), so against clipping in place first (a read and a write of every gradient) this
        saves the read, not the write. With found_inf == 1 it returns before reading anything, so the
        inf or NaN 1/c of a skipped step is never used. (torch's aten/src/ATen/native/cuda/
        fused_adam_utils.cuh and, on the CPU, FusedAdam.cpp + cpu/FusedAdamKernel.cpp.) g / fl(1/c)
        is within two fp32 ulps of clipping's g * c, and the same bits when c is 1.
        Clipping, foreach: it takes no grad_scale, so the gradients are scaled in a pass of their own."""
        fused = group["fused"]
        rows = []  # (param, grad, exp_avg, exp_avg_sq, step) of each parameter with a gradient
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # torch.optim.AdamW's state layout, so both load each other's state and match bitwise.
                step_device = p.device if fused else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            rows.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
        if fused and not isinstance(group["lr"], Tensor):
            large = [takes_triton_adamw(*r) for r in rows]
            if any(large):
                _triton_adamw(group, [r for r, big in zip(rows, large) if big], skip=skip, clip_coef=clip_coef)
                rows = [r for r, big in zip(rows, large) if not big]
        if not rows:
            return
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(column) for column in zip(*rows))
        if skip is not None and not fused and bool(skip):  # foreach AdamW has no found_inf: one sync
            return
        grad_scale = None
        if clip_coef is not None:
            if fused:
                grad_scale = clip_coef.reciprocal()
            else:
                torch._foreach_mul_(grads, clip_coef)
        beta1, beta2 = group["betas"]
        functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=None if fused else True, fused=fused or None, decoupled_weight_decay=True,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            found_inf=skip.float() if skip is not None and fused else None,  # the fused kernel skips on device
            grad_scale=grad_scale,
        )


def takes_triton_adamw(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor) -> bool:
    """Whether a fused AdamW group's parameter goes to ops.adamw: a plain (not DTensor-sharded) CUDA
    parameter of TRITON_ADAMW_MIN_NUMEL or more elements whose row the kernel accepts
    (ops.adamw.row_problem: contiguous fp32, 16-byte aligned, as torch allocates them)."""
    if not (param.is_cuda and type(param.data) is Tensor and param.numel() >= TRITON_ADAMW_MIN_NUMEL):
        return False
    from kimik3.ops.adamw import row_problem  # imports Triton: CUDA only

    return row_problem((param, grad, exp_avg, exp_avg_sq, step), param.device) is None


def _triton_adamw(group: dict, rows: list[tuple[Tensor, ...]], *, skip: Optional[Tensor],
                  clip_coef: Optional[Tensor]) -> None:
    """AdamW through ops.adamw (one launch) on (param, grad, exp_avg, exp_avg_sq, step) rows. The step
    counts move on the device, by 1 unless `skip` is set (torch's fused AdamW adds 1, then takes it
    back on a skip)."""
    from kimik3.ops.adamw import adamw_update_  # imports Triton: CUDA (or its interpreter) only

    params, grads, exp_avgs, exp_avg_sqs, steps = (list(column) for column in zip(*rows))
    if skip is None:
        torch._foreach_add_(steps, 1.0)
    else:  # one list entry per step: the overload taking a single tensor reads it on the host (a sync)
        keep = (~skip).float()
        torch._foreach_add_(steps, [keep] * len(steps))
    beta1, beta2 = group["betas"]
    adamw_update_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], weight_decay=group["weight_decay"],
                  beta1=beta1, beta2=beta2, eps=group["eps"], clip_coef=clip_coef, skip=skip)
