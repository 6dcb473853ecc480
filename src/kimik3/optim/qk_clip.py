"""QK-Clip (MuonClip, Kimi K2 report arXiv:2507.20534, Sec. 2.1 / Algorithm 1) for MLA layers.

After each optimizer step, for every MLA head h whose max pre-softmax logit S_max[h] over the
step's causal pairs exceeded tau, shrink that head's query and key weights so the same inputs
would give at most tau:  gamma = tau / S_max[h],
    q_nope[h] rows *= sqrt(gamma),   k_nope[h] rows (kv_b_proj) *= sqrt(gamma),
    q_rope[h] rows *= gamma,         k_rope (shared by all heads, kv_a_proj) untouched,
so both logit terms q_nope.k_nope and q_rope.k_rope scale by exactly gamma. Heads at or under tau
keep their weights bit for bit. The weights are changed in place; optimizer state is left as it is
(as in K2).

No host sync: every head's rows are multiplied by its factor on the device, 1.0 for the heads under
tau (exact), so the host never waits to learn whether anything was clipped; the trainer reads the
max logits, and so the clip events, one step later.

MLA layout (contract): the query projection (`q_proj`, or `q_b_proj` with a q LoRA) has rows
[h*(nope+rope) : (h+1)*(nope+rope)] per head, nope rows first; `kv_a_proj` has out rows
kv_lora_rank + rope, the last rope rows being k_rope; `kv_b_proj` has rows [h*(nope+v) :
(h+1)*(nope+v)] per head, k_nope rows first. Every MLA module has an fp32 buffer `max_logits` [H]
filled by its forward while `track_max_logits` is True. The sizes are read from the weight shapes
(H = max_logits.numel(), kv_lora_rank = kv_b_proj in features, rope = kv_a_proj rows - kv_lora_rank,
nope = query rows / H - rope), so nothing depends on config field names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class MLAHeadLayout:
    """Per-head row sizes of one MLA module, read from its weights."""

    num_heads: int
    nope: int
    rope: int
    v: int


def is_mla(module: nn.Module) -> bool:
    """True for modules with the MLA contract layout (a `max_logits` buffer and a `kv_b_proj`)."""
    return isinstance(getattr(module, "max_logits", None), Tensor) and hasattr(module, "kv_b_proj")


def query_projection(module: nn.Module) -> nn.Module:
    """The projection whose rows are per-head queries: q_b_proj with a q LoRA, else q_proj."""
    return module.q_b_proj if hasattr(module, "q_b_proj") else module.q_proj


def mla_head_layout(module: nn.Module) -> MLAHeadLayout:
    """Head count and per-head row sizes of an MLA module, derived from weight shapes."""
    num_heads = module.max_logits.numel()
    kv_lora_rank = module.kv_b_proj.weight.shape[1]
    rope = module.kv_a_proj.weight.shape[0] - kv_lora_rank
    q_rows = query_projection(module).weight.shape[0]
    kv_b_rows = module.kv_b_proj.weight.shape[0]
    if q_rows % num_heads or kv_b_rows % num_heads:
        raise ValueError(
            f"MLA projections ({q_rows} query rows, {kv_b_rows} kv_b rows) are not divisible "
            f"by max_logits heads={num_heads}"
        )
    nope = q_rows // num_heads - rope
    return MLAHeadLayout(num_heads, nope, rope, kv_b_rows // num_heads - nope)


def _scale_rows(proj: nn.Module, row_scale: Tensor) -> None:
    """Multiply output rows of a linear projection (weight [out, in], optional bias [out]) in place."""
    proj.weight.mul_(row_scale.to(proj.weight.dtype)[:, None])
    bias = getattr(proj, "bias", None)
    if bias is not None:
        bias.mul_(row_scale.to(bias.dtype))


def _global_max_logits(modules: list[nn.Module]) -> Tensor:
    """All modules' max_logits concatenated [sum H], maxed over data-parallel ranks in one
    all-reduce, so every rank clips the same heads by the same factor. The global values are also
    written back into each module's buffer: the model's `mla/layer<i>/max_logit` diagnostic reads
    it (after end_step), and must report the max QK-Clip compared with tau, not this rank's own."""
    s = torch.cat([m.max_logits.detach().float().flatten() for m in modules])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(s, op=dist.ReduceOp.MAX)
        for m, part in zip(modules, s.split([m.max_logits.numel() for m in modules])):
            m.max_logits.copy_(part.view_as(m.max_logits))
    return s


def _clip_module(module: nn.Module, s_max: Tensor, threshold: float, keep: Optional[Tensor]) -> None:
    """Apply QK-Clip to one MLA module given its heads' max logits s_max [H], on the device: every
    head's rows are scaled, by exactly 1.0 (a no-op, bit for bit) unless s_max > tau and `keep`
    (0-dim bool: the step's update was applied; None = yes)."""
    lay = mla_head_layout(module)
    clipped = s_max > threshold  # [H]
    if keep is not None:
        clipped = clipped & keep
    gamma = torch.where(clipped, threshold / s_max, torch.ones_like(s_max))  # [H]
    root = gamma.sqrt()
    # Per-row factors: query [H, nope + rope] -> sqrt(gamma) on nope rows, gamma on rope rows;
    # kv_b [H, nope + v] -> sqrt(gamma) on k_nope rows, 1 on v rows.
    q_scale = torch.cat(
        [root[:, None].expand(-1, lay.nope), gamma[:, None].expand(-1, lay.rope)], dim=1
    ).flatten()
    kv_scale = torch.cat(
        [root[:, None].expand(-1, lay.nope), torch.ones_like(gamma)[:, None].expand(-1, lay.v)], dim=1
    ).flatten()
    proj_q = query_projection(module)
    _scale_rows(proj_q, q_scale.to(proj_q.weight.device))
    _scale_rows(module.kv_b_proj, kv_scale.to(module.kv_b_proj.weight.device))


def _mla_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_mla(m)]


@torch.no_grad()
def clip_qk(model: nn.Module, threshold: Optional[float], keep: Optional[Tensor] = None) -> Optional[Tensor]:
    """Clip every MLA module of `model` on the device, without a host sync; returns the step's max
    logits of all heads [sum H] (what `qk_clip_events` reads), or None when QK-Clip is off
    (`threshold` None) or the model has no MLA layer.

    Call after `optimizer.step()` and before `model.on_step_end` (which resets the trackers).
    `keep`: a 0-dim bool tensor, False on a step whose update was skipped (nothing is clipped then).
    """
    if threshold is None:
        return None
    if threshold <= 0:
        raise ValueError(f"train.qk_clip_threshold={threshold} must be > 0 (or null to disable)")
    layers = _mla_layers(model)
    for name, module in layers:
        if not getattr(module, "track_max_logits", False):
            raise ValueError(
                f"QK-Clip needs MLA max logits but {name}.track_max_logits is False "
                "(enable tracking, or set train.qk_clip_threshold=null)"
            )
    if not layers:
        return None
    s_all = _global_max_logits([m for _, m in layers])
    for (_, module), s_max in zip(layers, s_all.split([m.max_logits.numel() for _, m in layers])):
        _clip_module(module, s_max, threshold, keep)
    return s_all


def qk_clip_events(model: nn.Module, max_logits: list[float], threshold: float) -> list[dict]:
    """Events {layer, head, max_logit, factor} of the heads `clip_qk` clipped, from the max logits it
    returned, read on the host (the trainer reads them one step later, when they are long computed)."""
    if not any(s > threshold for s in max_logits):  # the usual step: no walk over the model's modules
        return []
    events, offset = [], 0
    for name, module in _mla_layers(model):
        heads = module.max_logits.numel()
        for head, s in enumerate(max_logits[offset:offset + heads]):
            if s > threshold:
                events.append({"layer": name, "head": head, "max_logit": s, "factor": threshold / s})
        offset += heads
    return events


def apply_qk_clip(model: nn.Module, threshold: Optional[float]) -> list[dict]:
    """`clip_qk`, then its events read at once (one host sync): for callers outside the trainer."""
    s_all = clip_qk(model, threshold)
    return [] if s_all is None else qk_clip_events(model, s_all.tolist(), threshold)
