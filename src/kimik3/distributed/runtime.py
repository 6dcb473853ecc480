"""The process group of a run and the few collectives the trainer needs.

`setup_distributed(parallel, device)` turns the launcher's environment (env.py) into a
`DistContext`: it starts the process group (NCCL on CUDA, gloo on CPU), pins this rank to its GPU
(cuda:LOCAL_RANK) and checks that train.parallel fits the launch. A single process with
train.parallel=none starts no group at all, and every helper below is then the identity, so the
trainer calls them unconditionally and the single-process path stays exactly what it was.

Rank 0 owns the run dir (run.json, metrics.jsonl, train.log, TensorBoard, profiles); the other
ranks write nothing there unless KIMIK3_RANK_LOGS=1 asks for `train.rank<k>.log` files.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from kimik3.distributed.env import DistEnv, read_dist_env

RANK_LOGS_VAR = "KIMIK3_RANK_LOGS"
"""Set to 1 to give ranks > 0 their own `<run dir>/train.rank<k>.log` (they log nothing otherwise)."""
SUMMED_TRACKERS = ("step_load", "step_entropy")
"""Per-step MoE router statistics (models/moe.py buffers): summed over ranks before the router-bias
update, so every rank moves its bias by the same global load, as a single process would."""
TIMEOUT = timedelta(minutes=30)
"""Collective timeout: long enough for a first-step compile or a slow checkpoint write."""


@dataclass(frozen=True)
class DistContext:
    """Where this rank runs and with whom."""

    env: DistEnv
    device: torch.device
    parallel: str
    """none | ddp | fsdp (train.parallel)."""
    backend: Optional[str] = None
    """nccl | gloo when a process group is up; None for a single process."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main


def setup_distributed(parallel: str, device: torch.device, env: Optional[DistEnv] = None) -> DistContext:
    """Start the process group this launch asks for; see the module docstring."""
    env = read_dist_env() if env is None else env
    if env.world_size > 1 and parallel == "none":
        raise ValueError(
            f"{env.world_size} processes were launched ({env.launcher}) but train.parallel=none; "
            "set train.parallel=ddp or train.parallel=fsdp"
        )
    if parallel == "none":
        return DistContext(env, device, parallel)
    if env.launcher == "none":
        raise ValueError(
            f"train.parallel={parallel} needs a distributed launch: torchrun --nproc_per_node=<gpus> -m kimik3.train "
            "... (or -m hydra/launcher=slurm); use train.parallel=none for one process"
        )
    if device.type == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={env.local_rank} but this node has {torch.cuda.device_count()} CUDA device(s): "
                "launch at most one process per GPU"
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        init = "env://" if env.launcher == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(backend, init_method=init, rank=env.rank, world_size=env.world_size,
                                timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
    return DistContext(env, device, parallel, backend)


def teardown_distributed(ctx: DistContext) -> None:
    """Leave the process group (the next job of a sweep starts its own)."""
    if ctx.backend is not None and dist.is_initialized():
        dist.destroy_process_group()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _distributed():
        dist.barrier()


T = TypeVar("T")


def main_rank_first(work: Callable[[], T], what: str) -> T:
    """Run `work` on rank 0 alone, then on the other ranks once rank 0 has finished.

    For work that creates something shared on disk when it is missing (the prepared data dir):
    rank 0 creates it, the others find it done and only read it, so N ranks never build it N times
    or race on its publication. Rank 0's outcome is broadcast first, so when it fails the other ranks
    stop at once with one line naming `what` (instead of waiting out the collective timeout).
    One process: just `work()`. Several nodes with node-local storage: the other nodes' ranks find
    nothing and each run `work()` themselves, as before (point data.cache_dir at shared storage).
    """
    if not _distributed():
        return work()
    failure: list[Optional[str]] = [None]
    if dist.get_rank() == 0:
        try:
            return work()
        except Exception as e:
            failure[0] = f"{type(e).__name__}: {e}"
            raise
        finally:
            dist.broadcast_object_list(failure, src=0)
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise ValueError(f"rank 0 failed to {what}: {failure[0]}")
    return work()


def mean_over_ranks(x: Tensor) -> Tensor:
    """The mean of a 0-dim (or any) tensor over ranks: a new tensor, `x` untouched (identity for one process).

    SUM then divide: gloo has no AVG reduction."""
    if not _distributed():
        return x
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y / dist.get_world_size()


def full_value(x: Tensor) -> Tensor:
    """A plain tensor for a DTensor result (FSDP's grad norm is a DTensor with a pending reduction)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def replicate_plain_tensors() -> contextlib.AbstractContextManager:
    """In-place math that mixes FSDP's sharded weights with plain tensors (QK-Clip multiplies weight
    rows by a per-row scale [out, 1]) treats each plain tensor as replicated on every rank; without
    FSDP there are no DTensors and this changes nothing."""
    return implicit_replication()


def sum_step_trackers(model: nn.Module) -> None:
    """All-reduce (SUM) every MoE per-step tracker buffer in place, in one collective; see SUMMED_TRACKERS."""
    if not _distributed():
        return
    bufs = [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in SUMMED_TRACKERS]
    if not bufs:
        return
    flat = torch.cat([b.flatten().float() for b in bufs])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for b, part in zip(bufs, flat.split([b.numel() for b in bufs])):
        b.copy_(part.view_as(b))


def hydra_rank_overrides(env: DistEnv) -> list[str]:
    """Extra Hydra overrides for this rank: ranks > 0 save no `.hydra/` (every rank composes the
    same config into the same run dir; rank 0's copy is the record, and a second writer would race it)."""
    return [] if env.is_main else ["hydra.output_subdir=null"]


def configure_rank_logging(env: DistEnv, run_dir: Path, environ: Optional[Mapping[str, str]] = None) -> None:
    """Ranks > 0: drop Hydra's run-dir log file and console INFO lines (rank 0 reports for the job);
    with KIMIK3_RANK_LOGS=1 they log to `<run_dir>/train.rank<k>.log` instead."""
    if env.is_main:
        return
    environ = os.environ if environ is None else environ
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
        else:
            handler.setLevel(logging.WARNING)
    if environ.get(RANK_LOGS_VAR) == "1":
        handler = logging.FileHandler(Path(run_dir) / f"train.rank{env.rank}.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s][rank %(rank)s] %(message)s",
                                               defaults={"rank": env.rank}))
        root.addHandler(handler)


class NullMetrics:
    """What ranks > 0 log metrics to: nothing (rank 0's MetricsWriter holds the job's numbers)."""

    def __init__(self) -> None:
        self.sinks: list = []

    def log(self, event: str, step: int, tokens: int, fields: Optional[Mapping[str, object]] = None) -> dict:
        return {}

    def close(self) -> None:
        pass
