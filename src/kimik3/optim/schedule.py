"""Learning-rate schedules as pure functions of the optimizer step.

`lr_multiplier(step, cfg)` depends on nothing but its arguments, so a resumed run gets exactly the
learning rates of an uninterrupted one: the trainer restores `step` and calls it again (no scheduler
object to checkpoint). The trainer sets `group["lr"] = group["base_lr"] * lr_multiplier(step, cfg)`
before each optimizer step, where `step` counts the optimizer steps already done (0 for the first).

Shapes, with W = warmup_steps, N = max_steps, r = min_lr_ratio:
- warmup (all schedules): (step + 1) / W for step < W, so the first step already moves and step
  W - 1 reaches the peak. W >= N is allowed (a short run of a long recipe): the lr then rises
  for the whole run, to N / W of the peak at the last step, and the rest never starts.
- cosine: r + (1 - r) * (1 + cos(pi * p)) / 2 with p = (step - W) / (N - W), clamped to [0, 1];
  p = 1 (step >= N) gives r.
- wsd (warmup-stable-decay, MiniCPM arXiv:2404.06395): 1 until the last decay_fraction * N steps,
  then linear down to r at step N.
- constant: 1 after warmup (r is unused).
"""

from __future__ import annotations

import math

from kimik3.config.schema import SCHEDULES, TrainConfig


def wsd_decay_start(cfg: TrainConfig) -> int:
    """First step of the WSD decay phase: max_steps minus round(decay_fraction * max_steps)."""
    return cfg.max_steps - round(cfg.decay_fraction * cfg.max_steps)


def check_schedule(cfg: TrainConfig) -> None:
    """Raise ValueError (one line naming the fields) if the schedule fields cannot make a schedule."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"train.schedule={cfg.schedule!r} is not one of {list(SCHEDULES)}")
    if cfg.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps={cfg.warmup_steps} must be >= 0")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    if cfg.schedule == "wsd":
        if not 0.0 <= cfg.decay_fraction <= 1.0:
            raise ValueError(f"train.decay_fraction={cfg.decay_fraction} must be in [0, 1]")
        # A warmup ending inside the decay would jump from the ramp down into the middle of the
        # decay; one that lasts the whole run (>= max_steps) never reaches the decay at all.
        if wsd_decay_start(cfg) < cfg.warmup_steps < cfg.max_steps:
            raise ValueError(
                f"train.warmup_steps={cfg.warmup_steps} overlaps the WSD decay, which starts at step "
                f"{wsd_decay_start(cfg)} (train.max_steps={cfg.max_steps}, "
                f"train.decay_fraction={cfg.decay_fraction}): end it by then, or make it >= train.max_steps"
            )


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier of each group's base_lr for the optimizer step `step` (0-based steps done)."""
    check_schedule(cfg)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    r = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = cfg.max_steps - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: the decay's D = max_steps - start steps each step down by (1 - r) / D, so the run's last
    # step (max_steps - 1) trains at exactly r x peak, as "decay to r over the last D steps" says (the
    # decay's first step already below peak: a 1-step decay is one step at r, not one at peak)
    start = wsd_decay_start(cfg)
    if step < start:
        return 1.0
    span = cfg.max_steps - start
    progress = 1.0 if span <= 0 else min(1.0, (step - start + 1) / span)
    return 1.0 - (1.0 - r) * progress
