"""A weight's bf16 copy for a bf16 matmul, made and returned to fp32 in vectorised passes.

Why: mixed precision keeps fp32 weights and multiplies their bf16 copies: every step casts each
weight to bf16, and autograd turns each bf16 weight gradient back into fp32 with `Tensor.float()`.
PyTorch 2.11 runs both casts as unvectorised ("unrolled") elementwise kernels. On the H200 the
gradient casts took 16.0 ms of device time per kimi_3b_a1b step at T=8192 (478 calls, ~1.1 TB/s),
mostly the expert weights' (2.3B of its 2.96B parameters), and the weight casts 12.6 ms (548 calls,
~2.2 TB/s). `bf16_weight` does both in Triton kernels (cast_kernels.py) that move the bits as
integers in whole 16-byte vectors; off CUDA it is `Tensor.to` and `Tensor.float()`.

bf16 -> fp32 is exact (the fp32 bits are the bf16 bits followed by 16 zero bits) and fp32 -> bf16
rounds to nearest even as torch does, so both are bit-identical to torch's casts (NaNs stay NaN);
tests check that on random values, infs, NaNs, signed zeros and subnormals.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def _to_bf16(x: Tensor) -> Tensor:
    """x.to(bf16) for fp32 x; the vectorised kernel for a contiguous CUDA tensor."""
    if x.is_cuda and x.is_contiguous():
        from kimik3.ops.cast_kernels import downcast_fp32  # imports Triton: CUDA only

        return downcast_fp32(x)
    return x.to(torch.bfloat16)


def _to_fp32(grad: Tensor) -> Tensor:
    """grad.float(); the vectorised kernel for a contiguous bf16 CUDA tensor."""
    if grad.is_cuda and grad.dtype == torch.bfloat16 and grad.is_contiguous():
        from kimik3.ops.cast_kernels import upcast_bf16  # imports Triton: CUDA only

        return upcast_bf16(grad)
    return grad.float()


class _BF16Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        return _to_bf16(weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return _to_fp32(grad)


def bf16_weight(weight: Tensor) -> Tensor:
    """weight.to(bf16); for an fp32 CUDA weight the cast and its backward run the vectorised kernels
    of cast_kernels.py (see the module docstring)."""
    if weight.dtype != torch.float32:
        return weight.to(torch.bfloat16)
    return _BF16Weight.apply(weight)


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast runs a matmul in on this device type now, or None when autocast is off there."""
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_weight(weight: Tensor) -> Tensor:
    """The weight a matmul under autocast should multiply: for an fp32 weight under bf16 autocast
    on its device, `bf16_weight(weight)` (the values autocast's own cast gives, with the vectorised
    gradient cast); otherwise the weight itself, which autocast, if on, casts as usual.

    Why not leave it to autocast: autocast's copy returns its gradient through the unrolled cast
    kernel the module docstring measures (9.4 ms per kimi_3b_a1b step on the H200 for the
    projections once the experts went through `bf16_weight`).
    """
    if weight.dtype == torch.float32 and autocast_dtype(weight.device.type) == torch.bfloat16:
        return _BF16Weight.apply(weight)
    return weight


class _BF16Stacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, *weights: Tensor) -> Tensor:  # noqa: ANN001 (a cast_kernels.StackLayout)
        from kimik3.ops.cast_kernels import downcast_stacked  # imports Triton: CUDA only

        ctx.layout = layout
        return downcast_stacked(weights, layout)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from kimik3.ops.cast_kernels import upcast_stacked

        return None, *upcast_stacked(grad.contiguous(), ctx.layout)


def autocast_stacked(weights: Sequence[Tensor]) -> Tensor:
    """`torch.cat([autocast_weight(w) for w in weights])`, the weights a stacked projection multiplies
    (models/blocks.stacked_linear), with the same values and gradients. Under bf16 autocast on CUDA
    the casts and the stacking are one launch (cast_kernels.downcast_stacked) and the gradients come
    back in one launch too, as views of one fp32 buffer.

    Why: the per-weight path costs 2N + 1 launches (N casts, the copy into the stack, N gradient
    casts) and one more pass over the stacked weights. In the hybrid MoE's forward the host, not the
    GPU, sets the pace (kimik3.runs.gpu_idle), and a launch costs it more than the kernel costs the GPU.
    Falls back to the per-weight path for weights the kernels cannot take (stack_layout), for tensor
    subclasses (a sharded DTensor has no storage of its own to address) and while torch.compile
    traces."""
    first = weights[0]
    if (first.is_cuda and first.dtype == torch.float32 and autocast_dtype("cuda") == torch.bfloat16
            and not torch.compiler.is_compiling() and all(type(w.data) is Tensor for w in weights)):
        from kimik3.ops.cast_kernels import stack_layout  # imports Triton: CUDA only

        layout = stack_layout(weights)
        if layout is not None:
            return _BF16Stacked.apply(layout, *weights)
    return torch.cat([autocast_weight(w) for w in weights])


class _BF16Uses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, uses: int) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        copy = _to_bf16(x.contiguous())
        return tuple(copy.view_as(copy) for _ in range(uses))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        parts = [g.contiguous() for g in grads if g is not None]
        if not parts:
            return None, None
        if len(parts) == 1:
            return _to_fp32(parts[0]), None
        if parts[0].is_cuda:
            from kimik3.ops.cast_kernels import sum_bf16  # imports Triton: CUDA only

            return sum_bf16(parts), None
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total, None


def bf16_uses(x: Tensor, uses: int) -> tuple[Tensor, ...]:
    """`uses` aliases of one bf16 copy of the fp32 tensor x, one per consumer, whose gradients come back
    as their sum in fp32.

    Why: a tensor read by several bf16 matmuls is, under autocast, cast once per matmul, and autograd
    turns each bf16 gradient back into fp32 (the unrolled cast kernel) before it sums them; a single
    shared bf16 copy would instead sum its gradients in bf16. Here x is cast once (the vectorised
    kernel on CUDA) and the gradients meet in one fp32 pass (cast_kernels.sum_bf16): the values of
    autocast's casts, summed in fp32 as autograd would, in one pass each way. Consumers must not
    write into the aliases."""
    if x.dtype != torch.float32:
        raise ValueError(f"bf16_uses takes an fp32 tensor, got {x.dtype}")
    return _BF16Uses.apply(x, uses)
