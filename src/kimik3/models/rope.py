"""Rotary position embedding for MLA's shared key part when model.mla_use_rope is on.

Kimi Linear's MLA is NoPE (its KDA layers carry position), so this is off by default. Rotate-half
layout (GPT-NeoX / Llama): dims [0, R/2) pair with [R/2, R).
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, theta: float) -> Tensor:
    """Rotate x [B, T, ..., R] by position t along its last dim (R even), computed in fp32 (fp64 for
    fp64 x, so that the fp64 model checks are not limited to fp32 here)."""
    T, R = x.shape[1], x.shape[-1]
    if R % 2:
        raise ValueError(f"RoPE needs an even rotary dim, got qk_rope_head_dim={R}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, R, 2, device=x.device, dtype=dtype) / R)  # [R/2]
    angles = torch.arange(T, device=x.device, dtype=dtype)[:, None] * inv_freq  # [T, R/2]
    shape = (1, T) + (1,) * (x.ndim - 3) + (R // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
