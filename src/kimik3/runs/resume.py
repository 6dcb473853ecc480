"""Continuing from a checkpoint (train.resume): what must match, what may change, restoring each part.

**Must match** (refused with the field named, by kimik3.checkpoint.check_compatible): the model
config (but for kda_implementation, kda_chunk_size, name, init_from), the vocab, the dataset identity, seq_len, the
optimizer kind and the global batch (world_size x batch_size x grad_accum_steps). The weights, the
optimizer state and the loader cursor mean nothing under another value of these.

**May change, and the new value is applied**: everything else, typically lr and its schedule
(warmup_steps, schedule, min_lr_ratio, ...), max_steps / max_tokens, weight_decay, betas, eps,
grad_clip, the Muon settings, intervals, precision, device, parallel. Most of these are read from
the config each step anyway, but the optimizer's state_dict also carries its hyperparameters
(base_lr, weight_decay, betas, ...), so loading it would silently put the checkpoint's values back:
`restore` re-applies this session's values after loading. One log line and the "resume" event's
`changed` field list every field whose value differs from the checkpoint's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from kimik3.checkpoint import CheckpointError, check_compatible, resolve_resume
from kimik3.config.schema import TrainConfig
from kimik3.data import TokenDataLoader
from kimik3.distributed import DistContext
from kimik3.distributed.dcp import load_weights, read_resume_payload, rebase_loader_state
from kimik3.runs import run_dir as rundir
from kimik3.trainer import TrainState

log = logging.getLogger("kimik3")

NOT_COMPARED = ("train.resume",)
"""Config fields that naturally differ between a run and its continuation: not reported as changes."""


@dataclass
class Resumed:
    """What a resume restored beyond the objects it loaded in place."""

    path: Path
    """The checkpoint file or DCP dir that train.resume resolved to."""
    rng: dict
    """Generator states to restore right before the first step."""
    changed: dict[str, dict] = field(default_factory=dict)
    """'train.lr' -> {'checkpoint': old, 'now': new} for each field this session changes."""


def restore(resume: str, config: dict, recipe: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
            loaders: Mapping[str, TokenDataLoader], state: TrainState, ctx: DistContext, *,
            run_dir: Path, resume_here: bool) -> Resumed:
    """Check the checkpoint `resume` names against `recipe` and load it into the given parts.

    `config`: this session's resolved config (rundir.config_dict); its values win over the
    checkpoint's for every field the recipe does not pin (see the module docstring).
    """
    path = resolve_resume(resume)
    payload = read_resume_payload(path, ctx.rank)  # a .pt file or a DCP dir, saved at any world size
    check_compatible(payload["recipe"], recipe, path)
    if resume_here and payload["run_id"] != rundir.read_manifest(run_dir)["run_id"]:
        raise CheckpointError(f"{path} belongs to run {payload['run_id']!r}, not to the run in {run_dir}")
    chosen = optimizer_settings(optimizer)
    load_weights(path, payload, model, optimizer, ctx)
    apply_optimizer_settings(optimizer, chosen)
    for split, loader in loaders.items():
        loader.load_state_dict(rebase_loader_state(payload["loaders"][split], loader.batch_size, ctx.world_size))
    state.load_state_dict(payload["train_state"])
    changed = changed_fields(payload["config"], config)
    if changed:
        log.info("resume: %d field(s) differ from the checkpoint's recipe, this session's values apply: %s",
                 len(changed), ", ".join(f"{k} {v['checkpoint']!r} -> {v['now']!r}" for k, v in changed.items()))
    return Resumed(path=path, rng=payload["rng"], changed=changed)


def check_steps_left(cfg: TrainConfig, planned: int, resumed: Resumed, step: int) -> None:
    """A new run started from a checkpoint must have steps to run: with a plan (`planned`, from
    train.max_steps or train.max_tokens) at or below the checkpoint's `step` it would end at once, a
    finished run with no step of its own. (Continuing a run in place is not checked: after an
    interrupt that came right after the last checkpoint, it only records the run's end.)"""
    if planned > step:
        return
    name, plan = (("train.max_steps", f"train.max_steps={cfg.max_steps}") if planned == cfg.max_steps
                  else ("train.max_tokens", f"train.max_tokens={cfg.max_tokens} ({planned} steps)"))
    raise CheckpointError(f"{plan} is at or below step {step} of the checkpoint {resumed.path}: a run started from it "
                          f"would train no step; raise {name} past step {step}")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters (everything but its params), as build_optimizer set them."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """Put `settings` (from optimizer_settings) back over what load_state_dict restored."""
    if len(settings) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(optimizer.param_groups)} param groups, "
                              f"this session's {len(settings)}")
    for group, chosen in zip(optimizer.param_groups, settings):
        group.update(chosen)


def changed_fields(saved: dict, current: dict) -> dict[str, dict]:
    """Dotted config field -> {'checkpoint': saved value, 'now': current value}, for fields that differ."""
    diffs = sorted(d for d in rundir.diff_dicts(saved, current) if d[0] not in NOT_COMPARED)
    return {key: {"checkpoint": old, "now": new} for key, old, new in diffs}


__all__ = ["Resumed", "apply_optimizer_settings", "changed_fields", "check_steps_left", "optimizer_settings",
           "restore"]
