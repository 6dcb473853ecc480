"""The MoE router's selection after its GEMM, and the router-entropy statistic: one Triton kernel each
way on CUDA, the eager form elsewhere.

Shapes: N tokens, E experts, k experts per token. From the router logits x W_r^T [N, E] (fp32):

    scores  = sigmoid(logits)                                                         [N, E]
    chosen  = top-k of (scores + bias), best first, within the topk_group best of n_group
              groups (a group ranked by the sum of its two best values)               [N, k] int64
    weights = scores[chosen] / (sum of them + 1e-20) * scale                          [N, k]

(models/moe.Router holds the model-side description.) Why fused: eagerly this is ~9 small launches
forward (sigmoid, add, topk, gather, sum, add, div, mul, and the group masking's) and ~10 backward,
and the entropy statistic ~9 more, per MoE layer and step, over tensors of a few hundred KB: the
host's launch cost, where a MoE training step waits on the host (README, "Where the step waits for
the host"), not the GPU's time. Fused: one launch forward, one backward, one for the entropy.

Numerics: fp32 throughout, as the eager form. Ties between equal values pick the lower expert (and
group) index; the k chosen come best first, as torch.topk sorts them. The sum of the k chosen scores
may round in another order than torch's (weights within an ulp or so).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _fusable(logits: Tensor, n_group: int) -> bool:
    """The kernels take CUDA fp32 logits and power-of-two group counts (their tiles are powers of two)."""
    return logits.is_cuda and logits.dtype == torch.float32 and n_group & (n_group - 1) == 0


class _RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, bias: Tensor, k: int, n_group: int, topk_group: int, scale: float):
        from kimik3.ops.router_kernels import route_forward

        logits = logits.contiguous()
        N, E = logits.shape
        scores = torch.empty_like(logits)
        chosen = torch.empty(N, k, device=logits.device, dtype=torch.int64)
        weights = torch.empty(N, k, device=logits.device, dtype=torch.float32)
        route_forward(logits, bias.float().contiguous(), scores, chosen, weights, scale, n_group, topk_group)
        ctx.save_for_backward(scores, chosen)
        ctx.scale = scale
        ctx.mark_non_differentiable(chosen)
        ctx.set_materialize_grads(False)  # no zero tensor for an unused scores gradient
        return scores, chosen, weights

    @staticmethod
    def backward(ctx, d_scores: Optional[Tensor], _: None, d_weights: Optional[Tensor]):
        from kimik3.ops.router_kernels import route_backward

        scores, chosen = ctx.saved_tensors
        if d_weights is None and d_scores is None:
            return None, None, None, None, None, None
        if d_weights is None:
            d_weights = torch.zeros_like(chosen, dtype=torch.float32)
        d_logits = torch.empty_like(scores)
        route_backward(scores, chosen, d_weights.float().contiguous(),
                       d_scores.float().contiguous() if d_scores is not None else None, d_logits, ctx.scale)
        return d_logits, None, None, None, None, None


def _route_eager(logits: Tensor, bias: Tensor, k: int, n_group: int, topk_group: int,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    scores = torch.sigmoid(logits)
    choice = scores + bias
    if n_group > 1:  # keep only the topk_group groups with the best top-2 sums
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    chosen = choice.topk(k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, chosen)
    return scores, chosen, weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale


def route(logits: Tensor, bias: Tensor, k: int, n_group: int = 1, topk_group: int = 1, scale: float = 1.0,
          fused: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(scores [N, E], chosen [N, k] int64, weights [N, k]) from the router logits [N, E] and the
    balancing bias [E] (module docstring). fused: the Triton kernels (default: where they apply,
    CUDA fp32 logits and a power-of-two n_group); else the eager form."""
    if fused is None:
        fused = _fusable(logits, n_group)
    if fused:
        return _RouteFunction.apply(logits, bias, k, n_group, topk_group, float(scale))
    return _route_eager(logits, bias, k, n_group, topk_group, scale)


def entropy_sum(scores: Tensor, fused: Optional[bool] = None) -> Tensor:
    """[sum over tokens of the entropy of p = scores / sum(scores) (nats), tokens] as a 2-element tensor
    of the scores' dtype, on their device (no host sync). fused: the Triton kernel (default: CUDA fp32)."""
    if fused is None:
        fused = scores.is_cuda and scores.dtype == torch.float32
    if fused:
        from kimik3.ops import router_kernels

        out = torch.empty(2, device=scores.device, dtype=torch.float32)
        router_kernels.entropy_sum(scores.contiguous(), out)
        return out
    p = scores / scores.sum(-1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-20).log()).sum()
    # filled on the device: a tensor from host data (new_tensor) is a blocking copy on CUDA
    return torch.stack([entropy, torch.full_like(entropy, scores.shape[0])])
