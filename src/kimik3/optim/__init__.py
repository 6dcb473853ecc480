"""Optimizer recipe: parameter groups, Muon + AdamW, QK-Clip, learning-rate schedules.

Public interface (the trainer's seam):
- `build_optimizer(model, cfg) -> (optimizer, summary)`: one `MuonAdamW` whose param groups each
  carry "base_lr"; `summary` lists the groups (name, optimizer, count, numel, lr, wd, rules) for the
  run summary.
- `check_optimizer(cfg)`: the optimizer fields' own checks (build_optimizer runs them too).
- `lr_multiplier(step, cfg)`: pure schedule; the trainer sets group["lr"] = group["base_lr"] * mult.
- `optimizer.step(skip=..., clip_coef=...)`: the skip decision and the global grad-norm clip factor
  as 0-dim device tensors (no host sync); the step applies the factor as it reads the gradients.
- `clip_qk(model, threshold, keep)`: after each optimizer step, before model.on_step_end; clips on
  the device (no host sync) and returns the heads' max logits, which `qk_clip_events` turns into
  clip events {layer, head, max_logit, factor} once read. `apply_qk_clip(model, threshold)`: both
  at once, with a sync.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from kimik3.config.schema import OPTIMIZERS, TrainConfig
from kimik3.optim.groups import ADAMW_NO_DECAY, MUON, assign_groups, block_split
from kimik3.optim.muon import MuonAdamW
from kimik3.optim.qk_clip import apply_qk_clip, clip_qk, qk_clip_events
from kimik3.optim.schedule import check_schedule, lr_multiplier


def check_optimizer(cfg: TrainConfig) -> None:
    """Raise ValueError (one line naming the field) for optimizer, Muon, QK-Clip or schedule fields
    that cannot work; config validation may call it before anything is built."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer={cfg.optimizer!r} is not one of {list(OPTIMIZERS)}")
    for name, beta in (("train.beta1", cfg.beta1), ("train.beta2", cfg.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}={beta} must be in [0, 1)")
    for name, value in (("train.eps", cfg.eps), ("train.weight_decay", cfg.weight_decay)):
        if not value >= 0:
            raise ValueError(f"{name}={value} must be >= 0")
    if cfg.muon_ns_steps < 1:
        raise ValueError(f"train.muon_ns_steps={cfg.muon_ns_steps} must be >= 1")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ValueError(f"train.muon_momentum={cfg.muon_momentum} must be in [0, 1)")
    if cfg.muon_rms_scale <= 0:
        raise ValueError(f"train.muon_rms_scale={cfg.muon_rms_scale} must be > 0")
    if cfg.qk_clip_threshold is not None and cfg.qk_clip_threshold <= 0:
        raise ValueError(f"train.qk_clip_threshold={cfg.qk_clip_threshold} must be > 0 (or null to disable)")
    check_schedule(cfg)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[MuonAdamW, list[dict]]:
    """Build the optimizer for `model` from train.* (optimizer, lr, betas, muon_*) and describe its groups.

    Call it on the unwrapped model (parameter names are matched against the rules in groups.py).
    Muon and AdamW groups share the peak lr: Muon's update RMS is matched to AdamW's.
    """
    check_optimizer(cfg)
    param_groups, summary = [], []
    for name, members in assign_groups(model, cfg.optimizer).items():
        params = [p for _, _, p in members]
        wd = 0.0 if name == ADAMW_NO_DECAY else cfg.weight_decay
        group = {"params": params, "name": name, "lr": cfg.lr, "base_lr": cfg.lr, "weight_decay": wd}
        if name == MUON:
            splits = [block_split(model, n, cfg.muon_per_head) for n, _, _ in members]
            group.update(
                kind="muon", momentum=cfg.muon_momentum, nesterov=True, ns_steps=cfg.muon_ns_steps,
                rms_scale=cfg.muon_rms_scale, block_splits=splits,
            )
        else:
            group.update(kind="adamw", betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        param_groups.append(group)
        summary.append({
            "name": name, "optimizer": group["kind"], "count": len(params),
            "numel": sum(p.numel() for p in params), "lr": cfg.lr, "wd": wd,
            "rules": dict(Counter(rule.name for _, rule, _ in members)),
        })
    return MuonAdamW(param_groups), summary


__all__ = ["MuonAdamW", "apply_qk_clip", "build_optimizer", "check_optimizer", "clip_qk", "lr_multiplier",
           "qk_clip_events"]
