"""Optimizer recipe: parameter groups, Muon + AdamW, QK-Clip, learning-rate schedules.

Public interface (the trainer's seam):
- `build_optimizer(model, cfg) -> (optimizer, summary)`: one optimizer object whose param groups
  each carry "base_lr"; `summary` lists the groups (name, count, numel, lr, wd) for the run summary.
- `lr_multiplier(step, cfg)`: pure schedule; the trainer sets group["lr"] = group["base_lr"] * mult.
- `apply_qk_clip(model, threshold)`: after each optimizer step; returns clip events.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config.schema import TrainConfig
from kimik3.optim.groups import ADAMW_NO_DECAY, assign_groups
from kimik3.optim.qk_clip import apply_qk_clip
from kimik3.optim.schedule import check_schedule, lr_multiplier


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, list[dict]]:
    """Build the optimizer for `model` from train.* and describe its groups.

    Provisional: every group is AdamW until the Muon optimizer lands (same groups, same keys).
    """
    check_schedule(cfg)
    param_groups, summary = [], []
    for name, members in assign_groups(model, "adamw").items():
        wd = 0.0 if name == ADAMW_NO_DECAY else cfg.weight_decay
        params = [p for _, _, p in members]
        param_groups.append(
            {"params": params, "name": name, "lr": cfg.lr, "base_lr": cfg.lr, "weight_decay": wd}
        )
        summary.append(
            {"name": name, "count": len(params), "numel": sum(p.numel() for p in params),
             "lr": cfg.lr, "wd": wd}
        )
    opt = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return opt, summary


__all__ = ["apply_qk_clip", "build_optimizer", "lr_multiplier"]
