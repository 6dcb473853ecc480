"""Next-token cross-entropy through the LM head without holding full fp32 logits for the batch.

Shapes: N tokens, D hidden, V vocab.

Tokens are processed in chunks of about `_LOGIT_CHUNK_ELEMS / V`; each chunk's head matmul, fp32
upcast and log-softmax run under activation checkpointing, so only one chunk of logits exists at
a time, in forward and (recomputed) in backward. At V = 163840 a chunk is ~200 tokens and its
fp32 logits take 128 MiB, instead of N * V * 4 bytes (5 GiB at N = 8192).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
_LOGIT_CHUNK_ELEMS = 1 << 25


def _chunk_terms(hidden: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Sums over one chunk of CE and squared log-sum-exp (for the z-loss); ignored targets add 0."""
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [n, V] fp32 (fp64 stays)
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    valid = targets != IGNORE_INDEX
    target_logit = logits.gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    ce = torch.where(valid, lse - target_logit, 0.0)
    z = torch.where(valid, lse.pow(2), 0.0)
    return ce.sum(), z.sum()


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Mean next-token CE and mean z-loss term (log-sum-exp squared) over non-ignored targets.

    Args:
        hidden: [N, D] final hidden states; weight: [V, D] head weight; targets: [N] int64
            (IGNORE_INDEX = -100 is skipped).
    Returns:
        (ce, z) scalars in fp32 (fp64 for an fp64 model).
    """
    N, V = hidden.shape[0], weight.shape[0]
    chunk = max(1, _LOGIT_CHUNK_ELEMS // V)
    ce_sum = z_sum = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, N, chunk):
        args = (hidden[start : start + chunk], weight, targets[start : start + chunk])
        if torch.is_grad_enabled():
            ce, z = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            ce, z = _chunk_terms(*args)
        ce_sum, z_sum = ce_sum + ce, z_sum + z
    count = (targets != IGNORE_INDEX).sum().clamp_min(1)
    return ce_sum / count, z_sum / count
