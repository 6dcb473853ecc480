"""The readable block printed when a session starts: what runs, where, and the token budget plan.

The budget is arithmetic from the recipe (batch x seq x accum x steps), not a measurement; under
torchrun it counts the global batch (train.batch_size is per rank, so the ranks multiply it). The
smoke model says, on its own line, that it is a plumbing check and not a model result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kimik3.config.schema import RootConfig, TrainConfig

PLUMBING_NOTE = "smoke_test_lm is a plumbing check (embedding + head, no sequence mixing): its losses are not model results"


def format_summary(cfg: RootConfig, *, run_id: str, run_dir: Path, info: dict, device: str, precision: str,
                   groups: list[dict], train_ds, val_ds, steps: int, tokens_per_step: int, start_step: int,
                   resumed_from: Optional[Path], world_size: int = 1) -> str:
    """Multi-line summary; `train_ds`/`val_ds` are ShardedTokenDatasets (num_tokens, vocab_size, identity);
    `tokens_per_step` is global (all `world_size` ranks and accumulation steps together)."""
    t, m = cfg.train, cfg.model
    precision_note = f" (train.precision={t.precision})" if t.precision != precision else ""
    lines = [
        f"kimik3 run {run_id} -> {run_dir}",
        f"  model      {m.name} ({m.arch}): {_count(info['params_total'])} params, "
        f"{_count(info['params_activated'])} activated per token",
        f"  data       {train_ds.identity['name']}: train {_count(train_ds.num_tokens)} tokens, "
        f"val {_count(val_ds.num_tokens)}, vocab {train_ds.vocab_size}",
        f"  device     {device}, precision {precision}{precision_note}",
        f"  optimizer  {t.optimizer}, peak lr {t.lr:g}, weight decay {t.weight_decay:g}, "
        f"grad clip {t.grad_clip if t.grad_clip is not None else 'off'}, "
        f"qk-clip {t.qk_clip_threshold if t.qk_clip_threshold is not None else 'off'}",
    ]
    lines += [f"    {g['name']:<14} {g.get('optimizer', ''):<6} {g['count']:>4} tensors {_count(g['numel']):>7} "
              f"params  wd {g['wd']:g}" for g in groups]
    lines.append(f"  schedule   {_schedule(cfg)}")
    per_step = _per_step(t.batch_size, t.seq_len, t.grad_accum_steps, world_size, tokens_per_step)
    total = steps * tokens_per_step
    capped = f" (train.max_tokens={t.max_tokens:,} caps train.max_steps={t.max_steps})" if steps < t.max_steps else ""
    lines.append(f"  budget     {per_step}; {steps} steps{capped} = {total:,} tokens "
                 f"= {total / train_ds.num_tokens:.2f} epochs of the train split")
    lines.append(f"  eval       every {t.eval_interval} steps, {t.eval_steps} batches from the start of val; "
                 f"checkpoint every {t.checkpoint_interval} steps and at the end")
    if resumed_from is not None:
        lines.append(f"  resume     from {resumed_from} at step {start_step}")
    if m.arch == "smoke_test_lm":
        lines.append(f"  NOTE       {PLUMBING_NOTE}")
    return "\n".join(lines)


def warmup_warning(t: TrainConfig, steps: int) -> Optional[str]:
    """A warning when the warmup lasts the whole run (`steps` planned): accepted, as other trainers
    accept it (a short smoke run of a real recipe), but the lr then never gets past the ramp."""
    if t.warmup_steps < steps:
        return None
    return (f"warning: train.warmup_steps={t.warmup_steps} is not below the {steps} planned steps: the lr rises "
            f"for the whole run, to {steps / t.warmup_steps:.0%} of train.lr={t.lr:g} at the last step, and the "
            f"{t.schedule} phase never starts")


def schedule_cut_warning(t: TrainConfig, steps: int) -> Optional[str]:
    """A warning when train.max_tokens ends the run (`steps` planned) before train.max_steps, which the
    schedule spans (a pure function of the step and max_steps, so that a resume with a new token cap
    keeps the curve): the lr then never finishes its decay."""
    if steps >= t.max_steps or t.schedule == "constant":
        return None
    from kimik3.optim.schedule import lr_multiplier

    return (f"warning: train.max_tokens={t.max_tokens:,} ends the run after {steps} steps, before "
            f"train.max_steps={t.max_steps} that the {t.schedule} schedule spans: the last step trains at "
            f"{lr_multiplier(steps - 1, t):.0%} of train.lr={t.lr:g} (set train.max_steps={steps} to decay "
            f"within the run)")


def _per_step(batch_size: int, seq_len: int, accum: int, world_size: int, tokens_per_step: int) -> str:
    """The step's token arithmetic; with several ranks, the global batch and what it is made of."""
    if world_size == 1:
        return f"{batch_size} seqs x {seq_len} tokens x {accum} accum = {tokens_per_step:,} tokens/step"
    return (f"global batch {batch_size} seqs per rank x {world_size} ranks x {accum} accum = "
            f"{batch_size * world_size * accum} seqs x {seq_len} tokens = {tokens_per_step:,} tokens/step")


def _schedule(cfg: RootConfig) -> str:
    t = cfg.train
    warm = f"warmup {t.warmup_steps} step{'' if t.warmup_steps == 1 else 's'}"
    if t.schedule == "cosine":
        return f"cosine: {warm}, then cosine to {t.min_lr_ratio:g} x peak at step {t.max_steps}"
    if t.schedule == "wsd":
        decay = round(t.decay_fraction * t.max_steps)
        return f"wsd: {warm}, stable, linear decay to {t.min_lr_ratio:g} x peak over the last {decay} steps"
    return f"constant: {warm}, then constant"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
