"""Multi-process training on torch.distributed: torchrun or SLURM ranks, DDP / FSDP2, DCP checkpoints.

- env.py          launcher environment -> DistEnv (rank, local rank, world size, rendezvous)
- runtime.py      process group setup/teardown, the trainer's collectives, rank-0-only logging
- parallelize.py  DDP (composable replicate) or FSDP2 (fully_shard per block) on a built model
- dcp.py          sharded checkpoints with torch.distributed.checkpoint, loadable at any world size
Model code never imports this package; train.py applies it around the single-device pieces.
"""

from kimik3.distributed.env import DistEnv, read_dist_env, slurm_dist_env
from kimik3.distributed.parallelize import parallelize, set_grad_sync
from kimik3.distributed.runtime import (
    DistContext,
    NullMetrics,
    configure_rank_logging,
    full_value,
    hydra_rank_overrides,
    mean_over_ranks,
    replicate_plain_tensors,
    setup_distributed,
    sum_step_trackers,
    teardown_distributed,
)

__all__ = [
    "DistContext", "DistEnv", "NullMetrics", "configure_rank_logging", "full_value", "hydra_rank_overrides", "mean_over_ranks",
    "parallelize", "read_dist_env", "replicate_plain_tensors", "set_grad_sync", "setup_distributed",
    "slurm_dist_env", "sum_step_trackers", "teardown_distributed",
]
