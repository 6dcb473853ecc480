"""Data parallelism applied to a built single-device model: DDP or FSDP2, in place.

Model code never imports torch.distributed (STYLE.md, habit 6): `parallelize` is applied after
`build_model(...).to(device)` and before `build_optimizer` (FSDP2 swaps every parameter for a sharded
DTensor, so the optimizer must see the new ones). Both forms keep the model's class hooks
(`on_step_end`, `diagnostics`) and parameter names, so the trainer, the optimizer's name rules and
checkpoints see the same model as in a single process:

- ddp:  torch's composable `replicate` (DistributedDataParallel without the wrapper): full
        parameters on every rank, gradients all-reduced (averaged) in buckets during backward.
        Buffers are not broadcast from rank 0: the MoE router bias stays equal on all ranks by
        construction (it moves by the all-reduced load, runtime.sum_step_trackers), and the
        per-step trackers must keep each rank's own counts until that reduction.
- fsdp: FSDP2 `fully_shard` on every block of `model.layers`, then on the root (embeddings,
        final norm, head). Parameters, gradients and optimizer state are sharded on dim 0 across
        ranks; each block's parameters are all-gathered for its forward and backward and its
        gradients reduce-scattered. Precision bf16: MixedPrecisionPolicy(param_dtype=bf16,
        reduce_dtype=fp32) (bf16 compute and all-gathers, fp32 gradient reduction and fp32 master
        weights and optimizer state); fp32: no policy. Works on CPU with gloo in fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kimik3.distributed.runtime import DistContext


def parallelize(model: nn.Module, ctx: DistContext, precision: str) -> nn.Module:
    """Apply ctx.parallel (none | ddp | fsdp) to `model` in place and return it."""
    if ctx.parallel == "none":
        return model
    if ctx.parallel == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return replicate(model, device_ids=device_ids, broadcast_buffers=False)
    if ctx.parallel == "fsdp":
        if precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        for block in getattr(model, "layers", ()):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    raise ValueError(f"train.parallel={ctx.parallel!r} is not one of ['none', 'ddp', 'fsdp']")


def set_grad_sync(model: nn.Module, on: bool) -> None:
    """Gradient accumulation: DDP skips its all-reduce on all but a step's last micro-batch (no_sync).

    FSDP keeps reduce-scattering every micro-batch: skipping would hold full unsharded gradients
    between micro-batches, which is the memory FSDP exists to save. One process: nothing to do.
    """
    if isinstance(model, DDP):
        model.set_requires_gradient_sync(on)
