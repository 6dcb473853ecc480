"""Exact causal max pre-softmax logit per head (QK-Clip's statistic), without materialising logits.

Shapes: B batch, H heads, T time, D query/key dim, BM x BN the score tile of one program step.

    max_logits[h] = max over b and causal pairs (i >= j) of scale * q[b, h, i] . k[b, h, j]

SDPA never exposes its logits, so MLA recomputes this under no_grad. In PyTorch that is a blocked
fp32 Q K^T (models/mla.py) whose cost grows as T^2 with every logit written to memory; this kernel
keeps one [BM, BN] score tile in registers, walks only the causal key blocks and writes one
number per (batch, head, query block). The dot runs on the stored dtype with fp32 accumulation
(bf16 products are exact in fp32; fp32 inputs use IEEE fp32, never TF32), so the maximum equals the
fp32 reference up to summation order. Scaling after the max is exact: scale > 0 and rounding is
monotone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_interpret import patch_interpreter_scalar_index

patch_interpreter_scalar_index()  # runtime loop bounds under TRITON_INTERPRET=1 (CPU tests)

BLOCK_M = 128
BLOCK_N = 64


@triton.jit
def _causal_max_logit_kernel(q_ptr, k_ptr, out_ptr, T, H, sqb, sqh, sqt, skb, skh, skt,
                             D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             PREC: tl.constexpr):
    """One program per (query block, batch * head): max of q k^T over its causal key blocks."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    q_base = q_ptr + (bh // H) * sqb + (bh % H) * sqh
    k_base = k_ptr + (bh // H) * skb + (bh % H) * skh
    rows = pid_m * BM + tl.arange(0, BM)
    best = tl.full([BM], float("-inf"), tl.float32)
    end = tl.minimum((pid_m + 1) * BM, T)
    for start_n in range(0, end, BN):
        cols = start_n + tl.arange(0, BN)
        s = tl.zeros([BM, BN], dtype=tl.float32)
        for d in tl.static_range(0, D, BD):
            dims = d + tl.arange(0, BD)
            q = tl.load(q_base + rows[:, None] * sqt + dims[None, :], mask=rows[:, None] < T, other=0.0)
            k = tl.load(k_base + cols[None, :] * skt + dims[:, None], mask=cols[None, :] < T, other=0.0)
            s = tl.dot(q, k, s, input_precision=PREC)  # [BM, BD] x [BD, BN]
        causal = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T)
        best = tl.maximum(best, tl.max(tl.where(causal, s, float("-inf")), axis=1))
    tl.store(out_ptr + bh * tl.num_programs(0) + pid_m, tl.max(best, axis=0))


def causal_max_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Per-head max over the batch of the causal logits scale * q k^T.

    Args:
        q, k: [B, H, T, D], any strides with a unit last-dim stride (the transposed views MLA has);
            D a multiple of 16; bf16, fp16 or fp32. scale: a positive softmax scale.
    Returns:
        [H] fp32.
    """
    B, H, T, D = q.shape
    if k.shape != q.shape or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"causal_max_logits needs q, k of one shape with unit last stride, got "
                         f"{tuple(q.shape)} / {tuple(k.shape)}, strides {q.stride()} / {k.stride()}")
    if D % 16 or scale <= 0:
        raise ValueError(f"causal_max_logits needs D a multiple of 16 and scale > 0, got D={D}, scale={scale}")
    bd = next(b for b in (64, 32, 16) if D % b == 0)
    blocks = triton.cdiv(T, BLOCK_M)
    partial = torch.empty(B * H, blocks, device=q.device, dtype=torch.float32)
    _causal_max_logit_kernel[(blocks, B * H)](
        q, k, partial, T, H, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        D=D, BD=bd, BM=BLOCK_M, BN=BLOCK_N, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return partial.view(B, H, blocks).amax(dim=(0, 2)) * scale
