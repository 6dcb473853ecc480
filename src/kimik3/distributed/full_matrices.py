"""Whole-matrix math on FSDP-sharded tensors: the hook that keeps Muon exact under FSDP2.

Muon's Newton-Schulz iteration (optim/muon.py) needs each weight matrix whole, but FSDP2 keeps only
a dim-0 shard of every parameter, gradient and momentum buffer on each rank (DTensor Shard(0)).
`on_full_matrices` all-gathers the sharded inputs, runs the single-device function on the full
tensors on every rank (deterministic, so every rank computes the same result) and hands back each
rank's own shard of the outputs. The update therefore equals the single-process update. It costs
one all-gather per matrix and world_size-fold redundant Newton-Schulz work; distributing whole
matrices over ranks and broadcasting results would cut the compute, not the exactness.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def on_full_matrices(fn: Callable[[list[Tensor]], list[Tensor]], tensors: list[Tensor]) -> list[Tensor]:
    """fn(tensors) for plain tensors; for DTensors, fn on their full values, resharded like the inputs."""
    if not any(isinstance(t, DTensor) for t in tensors):
        return fn(tensors)
    full = fn([t.full_tensor() if isinstance(t, DTensor) else t for t in tensors])
    return [
        distribute_tensor(o, t.device_mesh, t.placements, src_data_rank=None) if isinstance(t, DTensor) else o
        for o, t in zip(full, tensors)
    ]
