"""KDA's per-channel decay gate and the other pointwise prologue steps, in plain PyTorch.

These are the reference for what the Triton kernels fuse (gate activation, beta sigmoid,
q/k L2 norm). Shapes: f [B, T, H, K] gate pre-activation; A_log, dt_bias per head/channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kda_gate(
    f: Tensor, A_log: Tensor, dt_bias: Tensor, *, form: str, lower_bound: float = -5.0
) -> Tensor:
    """Log-space decay g from the gate pre-activation f, computed in fp32 (fp64 for fp64 f).

    softplus (Kimi Linear): g = -exp(A_log) * softplus(f + dt_bias), unbounded below.
    bounded: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), so g lies in (lower_bound, 0),
    which keeps exp(-g) bounded inside a chunk (a numerically safer form for long chunks).

    Args:
        f: [B, T, H, K] gate pre-activation.
        A_log: [H] per-head log rate.
        dt_bias: [H * K] per-channel bias.
    Returns:
        g: [B, T, H, K] fp32 (fp64 for fp64 f), <= 0.
    """
    H, K = f.shape[-2], f.shape[-1]
    dtype = torch.promote_types(f.dtype, torch.float32)  # fp32 (fp64 stays fp64, for the fp64 checks)
    x = f.to(dtype) + dt_bias.to(dtype).view(H, K)
    rate = A_log.to(dtype).exp().view(H, 1)
    if form == "softplus":
        return -rate * F.softplus(x)
    if form == "bounded":
        return lower_bound * torch.sigmoid(rate * x)
    raise ValueError(f"gate form {form!r} is not one of 'softplus', 'bounded'")


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """L2-normalise the last dim in fp32 (fp64 stays fp64; q and k of KDA), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
