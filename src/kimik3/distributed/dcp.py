"""Checkpoints of multi-process runs with torch.distributed.checkpoint (DCP), loadable at any world size.

A run with world_size > 1 saves `checkpoints/step-<n>/`, a directory instead of the single-process
`step-<n>.pt` file (kimik3.checkpoint):
  .metadata, __<r>_0.distcp   DCP: model and optimizer state, each rank writing only its own shards
                              (FSDP) or, for replicated tensors (DDP), rank 0 writing them once
  meta.pt                     run_id, recipe, config, train_state, loader cursors (the same on every
                              rank: the cursor is the global batch's position), written by rank 0 in
                              the single-process format (kimik3.checkpoint.save_checkpoint)
  rng-rank<r>.pt              rank r's generator states
Keys are parameter names (FQNs), so a DCP checkpoint loads into any sharding and any world size,
one process included (DCP then runs without a process group): that is the resharding. Every rank
writes into `.step-<n>.tmp/`, and rank 0 renames it once all ranks are done, so a crash mid-save
leaves no directory that resume would pick up.

Loading works from either format: a DCP directory, or a single-process `.pt` into a replicated
or sharded model (every rank reads the full file; FSDP keeps its shard). The loader cursor is kept
in tokens, so it carries over to any split of the same global batch (world_size x batch_size x
grad_accum_steps, which kimik3.checkpoint.check_compatible compares); see `rebase_loader_state`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kimik3.checkpoint import CheckpointError, capture_rng, is_sharded_checkpoint, load_checkpoint, save_checkpoint
from kimik3.distributed.runtime import DistContext, barrier

META_FILE = "meta.pt"


def sharded_checkpoint_path(single_path: Path) -> Path:
    """`checkpoints/step-000100.pt` -> `checkpoints/step-000100` (the DCP directory of the same step)."""
    return Path(single_path).with_suffix("")


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                 ctx: DistContext) -> Path:
    """Collective: every rank calls it. Writes the DCP directory `path` (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    torch.save(capture_rng(), tmp / f"rng-rank{ctx.rank}.pt")
    barrier()
    if ctx.is_main:
        save_checkpoint(tmp / META_FILE, {**meta, "world_size": ctx.world_size})
        if path.exists():  # the same step saved again (data ran out right after a checkpoint step)
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    barrier()
    return path


def read_resume_payload(path: Path, rank: int) -> dict:
    """What to resume from, without model and optimizer tensors for a DCP directory (see `load_weights`).

    A `.pt` file: its whole payload. A DCP directory: meta.pt plus "rng" = this rank's generator
    states (rank 0's when the saving run had fewer ranks).
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        return load_checkpoint(path)
    payload = load_checkpoint(path / META_FILE)
    rng_file = path / f"rng-rank{rank}.pt"
    payload["rng"] = torch.load(rng_file if rng_file.is_file() else path / "rng-rank0.pt", weights_only=True)
    return payload


def load_weights(path: Path, payload: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: DistContext) -> None:
    """Load model and optimizer state from either checkpoint format into a model of any parallelism."""
    path = Path(path)
    if ctx.parallel == "none" and not is_sharded_checkpoint(path):  # the single-process path, as saved
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        return
    if is_sharded_checkpoint(path):
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, payload["model"], options=full)
    set_optimizer_state_dict(model, optimizer, _by_name(payload["optimizer"], model, optimizer), options=full)


def read_model_state(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta.pt's payload, the full model state by parameter name) of a DCP directory, read in this
    one process without a process group: what `kimik3-convert export` and `model.init_from` take
    from a torchrun run. The tensors are allocated from the checkpoint's own metadata (names, shapes,
    dtypes), so no model needs to be built; the optimizer state is not read."""
    path = Path(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = "model."
    model = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return load_checkpoint(path / META_FILE), state["model"]


def rebase_loader_state(saved: dict, batch_size: int, world_size: int) -> dict:
    """A loader cursor saved under another split of the same global batch, re-expressed for this one.

    The position is in tokens (the start of the next global batch) and means the same thing for
    any world_size x batch_size. It is a whole number of global batches, except after a
    data_end=next_epoch rewind between two micro-batches of a step: then only a split whose
    micro-batch (world_size x batch_size x seq_len tokens) divides it can continue, and any other
    one is refused here with the split that can (TokenDataLoader.load_state_dict would only say
    "not a cursor of this loader").
    """
    micro = world_size * batch_size * saved["seq_len"]
    if saved["position"] % micro:
        raise CheckpointError(
            f"the checkpoint's {saved['split']} cursor at token {saved['position']} is inside a step (an epoch "
            f"rewind between its micro-batches), which {world_size} x {batch_size} x {saved['seq_len']} = {micro} "
            f"tokens per micro-batch cannot continue from; resume with the checkpoint's split, {saved['world_size']} "
            f"rank(s) x train.batch_size={saved['batch_size']}"
        )
    return {**saved, "batch_size": batch_size, "world_size": world_size}


def _by_name(optim_state: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """torch's optimizer.state_dict() (params numbered in param-group order) -> the same keyed by
    parameter name, the form `set_optimizer_state_dict` takes. The numbering matches because both
    optimizers come from build_optimizer on the same model (the recipe check guarantees it)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for group in optim_state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": {names[i]: s for i, s in optim_state["state"].items()}, "param_groups": groups}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["load_weights", "read_model_state", "read_resume_payload", "rebase_loader_state", "save_sharded",
           "sharded_checkpoint_path"]

