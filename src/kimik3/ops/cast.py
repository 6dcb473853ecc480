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

import torch
from torch import Tensor


class _BF16Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        if weight.is_cuda and weight.is_contiguous():
            from kimik3.ops.cast_kernels import downcast_fp32  # imports Triton: CUDA only

            return downcast_fp32(weight)
        return weight.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if grad.is_cuda and grad.dtype == torch.bfloat16 and grad.is_contiguous():
            from kimik3.ops.cast_kernels import upcast_bf16  # imports Triton: CUDA only

            return upcast_bf16(grad)
        return grad.float()


def bf16_weight(weight: Tensor) -> Tensor:
    """weight.to(bf16); for an fp32 CUDA weight the cast and its backward run the vectorised kernels
    of cast_kernels.py (see the module docstring)."""
    if weight.dtype != torch.float32:
        return weight.to(torch.bfloat16)
    return _BF16Weight.apply(weight)


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_weight(weight: Tensor) -> Tensor:
    """The weight a matmul under autocast should multiply: for an fp32 weight under bf16 autocast
    on its device, `bf16_weight(weight)` (the values autocast's own cast gives, with the vectorised
    gradient cast); otherwise the weight itself, which autocast, if on, casts as usual.

    Why not leave it to autocast: autocast's copy returns its gradient through the unrolled cast
    kernel the module docstring measures (9.4 ms per kimi_3b_a1b step on the H200 for the
    projections once the experts went through `bf16_weight`).
    """
    device = weight.device.type
    if (weight.dtype == torch.float32 and device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == torch.bfloat16):
        return _BF16Weight.apply(weight)
    return weight
