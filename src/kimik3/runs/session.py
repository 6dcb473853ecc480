"""One training session in a run dir: data, model, optimizer, resume, run.json session, then the trainer.

`run(cfg, run_dir, ...)` is what a Hydra job (runs/job.py) calls, and what tests call without
Hydra. A session is a fresh run or the continuation of one (train.resume; runs/resume.py).
Under torchrun (or the SLURM launcher) every rank calls it; rank 0 alone writes the run dir, and
rank 0 alone prepares missing data while the others wait for it (kimik3.distributed).

Jobs of a sweep may share a process (Hydra's basic launcher runs them all in one, a joblib worker
several in turn), so each session starts from `seed_everything` and ends with
`release_process_state` (hydra #2631).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from kimik3.checkpoint import (capture_rng, checkpoint_path, recipe_of, remove_killed_writes, restore_rng,
                               save_checkpoint)
from kimik3.config.schema import RootConfig
from kimik3.config.validate import (planned_steps, resolve_device, resolve_precision, validate_val_split,
                                    validate_vocab)
from kimik3.data import ShardedTokenDataset, TokenDataLoader, prepare_data
from kimik3.distributed import DistContext, NullMetrics, parallelize, setup_distributed, teardown_distributed
from kimik3.distributed.dcp import save_sharded, sharded_checkpoint_path
from kimik3.distributed.runtime import main_rank_first
from kimik3.models import build_model
from kimik3.models.flops import flops_per_token, parameter_counts
from kimik3.optim import build_optimizer
from kimik3.runs import run_dir as rundir
from kimik3.runs.interrupts import interrupt_cause, interrupts_held
from kimik3.runs.metrics import MetricsWriter, peak_flops
from kimik3.runs.profile import StepProfiler
from kimik3.runs.progress import Progress
from kimik3.runs.resume import check_steps_left, restore
from kimik3.runs.summary import format_summary, schedule_cut_warning, warmup_warning
from kimik3.trainer import Throughput, TrainState, train

log = logging.getLogger("kimik3")


def run(cfg: RootConfig, run_dir: Path, *, run_id: str, overrides: list[str] = (), resume_here: bool = False,
        reproduce_from: Optional[Path] = None, tty: Optional[bool] = None) -> float:
    """Train `cfg` (already validated) into `run_dir`; returns the objective (train.objective).

    `resume_here`: the run dir holds the run being resumed. `reproduce_from`: a run dir whose
    resolved recipe must equal `cfg`.
    """
    ctx = setup_distributed(cfg.train.parallel, resolve_device(cfg.train.device))
    try:
        return _run(cfg, Path(run_dir), ctx, run_id=run_id, overrides=overrides, resume_here=resume_here,
                    reproduce_from=reproduce_from, tty=tty)
    finally:
        teardown_distributed(ctx)
        release_process_state(ctx.device)


def _run(cfg: RootConfig, run_dir: Path, ctx: DistContext, *, run_id: str, overrides: list[str], resume_here: bool,
         reproduce_from: Optional[Path], tty: Optional[bool]) -> float:
    t = cfg.train
    if reproduce_from is not None:
        rundir.compare_recipes(rundir.saved_recipe(reproduce_from), rundir.config_dict(cfg), str(reproduce_from))
    if ctx.is_main:
        rundir.check_new_or_resuming(run_dir, resume_here)
        if resume_here:
            for path in remove_killed_writes(run_dir):
                log.info("removed %s, a checkpoint write whose process was killed", path)
    device = ctx.device
    precision = resolve_precision(t.precision, device)
    seed_everything(t.seed, t.deterministic)

    data_path = main_rank_first(lambda: prepare_data(cfg.data), "prepare the data")
    train_ds, val_ds = ShardedTokenDataset(data_path, "train"), ShardedTokenDataset(data_path, "val")
    if reproduce_from is not None and (reproduce_from / rundir.MANIFEST).is_file():  # the same data, not just its name
        rundir.compare_recipes({"dataset": rundir.read_manifest(reproduce_from)["dataset"]},
                               {"dataset": train_ds.identity}, str(reproduce_from))
    validate_vocab(cfg.model, train_ds.vocab_size, str(data_path))
    validate_val_split(val_ds.num_tokens, val_ds.meta.get("val_fraction"), str(data_path))
    train_loader = TokenDataLoader(train_ds, t.batch_size, t.seq_len, rank=ctx.rank, world_size=ctx.world_size)
    val_loader = TokenDataLoader(val_ds, t.batch_size, t.seq_len, rank=ctx.rank, world_size=ctx.world_size)
    model = build_training_model(cfg, train_ds.vocab_size, ctx, precision)
    optimizer, groups = build_optimizer(model, t)
    recipe = recipe_of(rundir.config_dict(cfg.model), train_ds.vocab_size, train_ds.identity,
                       rundir.config_dict(t), world_size=ctx.world_size)

    state, resumed = TrainState(), None
    if t.resume is not None:
        # the train cursor only: every eval rewinds the val loader first, so its saved position (a multiple
        # of the saving run's batch, which another split of the same global batch need not divide) is moot
        resumed = restore(t.resume, rundir.config_dict(cfg), recipe, model, optimizer, {"train": train_loader},
                          state, ctx, run_dir=run_dir, resume_here=resume_here)
    tokens_per_step = train_loader.tokens_per_step * t.grad_accum_steps
    steps = planned_steps(t, tokens_per_step)
    if resumed is not None and not resume_here:
        check_steps_left(t, steps, resumed, state.step)

    def save(s: TrainState) -> Path:
        meta = {"run_id": run_id, "recipe": recipe, "config": rundir.config_dict(cfg), "train_state": s.state_dict(),
                "loaders": {"train": train_loader.state_dict(), "val": val_loader.state_dict()}}
        with interrupts_held():  # a stop waits for the write (runs/interrupts.py says why)
            if ctx.parallel != "none":  # collective: every rank writes its shards
                return save_sharded(sharded_checkpoint_path(checkpoint_path(run_dir, s.step)), model, optimizer, meta,
                                    ctx)
            return save_checkpoint(checkpoint_path(run_dir, s.step), {
                **meta, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng()})

    peak = peak_flops(device)
    info = _model_info(model, cfg, train_ds.vocab_size)
    session = {"resumed_from": str(resumed.path) if resumed else None, "world_size": ctx.world_size,
               "parallel": ctx.parallel, "launcher": ctx.env.launcher,
               "torch_version": torch.__version__, "device": _device_name(device, ctx.world_size),
               "precision": precision,
               "kda_implementation": cfg.model.kda_implementation,
               "peak_flops": {"name": peak[0], "value": peak[1]} if peak else None}
    if ctx.is_main:
        manifest = rundir.start_session(run_dir, run_id=run_id, cfg=cfg, overrides=list(overrides), model=info,
                                        dataset=train_ds.identity, session=session)
        metrics, session_id = MetricsWriter(run_dir), manifest["sessions"][-1]["session_id"]
    else:
        metrics, session_id = NullMetrics(), None
    progress = profiler = None
    status = "failed"
    try:
        metrics.sinks.extend(_sinks(t.logger if ctx.is_main else "none", run_dir))
        metrics.log("start", state.step, state.tokens, {"run_id": run_id, "session_id": session_id, **session})
        if resumed is not None:
            metrics.log("resume", state.step, state.tokens, {"from": str(resumed.path), "changed": resumed.changed})
        log.info(format_summary(cfg, run_id=run_id, run_dir=run_dir, info=info, device=session["device"],
                                precision=precision, groups=groups, train_ds=train_ds, val_ds=val_ds,
                                steps=steps, tokens_per_step=tokens_per_step,
                                start_step=state.step, resumed_from=resumed.path if resumed else None,
                                world_size=ctx.world_size))
        for warning in (warmup_warning(t, steps), schedule_cut_warning(t, steps)) if ctx.is_main else ():
            if warning is not None:  # the job's config, the same on every rank: rank 0 says it once
                log.warning(warning)
        progress = Progress(steps, state.step, tty=tty if ctx.is_main else False)
        if t.profile.enabled and ctx.is_main:
            profiler = StepProfiler(t.profile, run_dir / "profile", device, state.step)
        if resumed is not None:
            restore_rng(resumed.rng)
        result = train(model, optimizer, train_loader, val_loader, t, state, device=device, precision=precision,
                       metrics=metrics, save=save, progress=progress, profiler=profiler,
                       throughput=Throughput(flops_per_token=_flops_per_token(cfg, train_ds.vocab_size), peak=peak,
                                             world_size=ctx.world_size))
        objective = state.val_loss if t.objective == "val_loss" else state.train_loss
        if objective is None or not math.isfinite(objective):  # -> status failed, error.txt, no objective
            raise ValueError(f"train.objective={t.objective} is {objective} after {state.step} steps "
                             f"({state.skipped} updates skipped as non-finite): the run diverged")
        status = result.status
        metrics.log("end", state.step, state.tokens, {"status": status, "val_loss": state.val_loss,
                                                      "train_loss": state.train_loss, "objective": objective})
        log.info(f"{status}: step {state.step}, {state.tokens:,} tokens, train_loss {_fmt(state.train_loss)}, "
                 f"val_loss {_fmt(state.val_loss)}, {state.skipped} skipped; run dir {run_dir}")
        return objective
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        status = "interrupted" if interrupted else "failed"
        error = f"interrupted ({interrupt_cause(e)})" if interrupted else f"{type(e).__name__}: {e}"
        _best_effort(lambda: metrics.log("end", state.step, state.tokens, {
            "status": status, "error": error, "val_loss": state.val_loss, "train_loss": state.train_loss,
            "objective": None}))
        raise
    finally:
        closing = [part.close for part in (profiler, progress, metrics) if part is not None]
        if ctx.is_main:
            closing.append(lambda: rundir.end_session(run_dir, status, state.step))
        for close in closing:
            if status in ("failed", "interrupted"):
                _best_effort(close)
            else:
                close()


def _best_effort(record: Callable[[], object]) -> None:
    """Run one of a failing session's closing writes (its end event, writers, run.json). The failure
    may be a full disk, which then refuses these writes too: that is logged, not raised, so the
    error the job reports stays the session's own, not a chain of the same one."""
    try:
        record()
    except OSError as e:
        log.warning("while ending the failed session: %s", e)


def build_training_model(cfg: RootConfig, vocab_size: int, ctx: DistContext, precision: str) -> nn.Module:
    """The model on its device, with initial weights (model.init_from), compiled (train.compile) and
    parallelized (train.parallel), in that order: ready for build_optimizer. Public because
    benchmarks/train_step.py builds its timed model through it too, so a recipe's train.compile (or any
    later build step) cannot be reported by the benchmark without being run."""
    with ctx.device:  # create and initialise parameters on the device: ~1 s for 3B on a GPU, ~20 s on host cores
        model = build_model(cfg.model, vocab_size)
    if cfg.model.init_from is not None and cfg.train.resume is None:  # kimik3.hf: checked, weights only
        from kimik3.hf import load_initial_weights  # needs the [hf] extra (safetensors): imported only when used

        log.info("model.init_from: %s", load_initial_weights(model, cfg.model, cfg.model.init_from))
    if cfg.train.compile:
        log.info("train.compile: %s", compile_blocks(model))
    return parallelize(model, ctx, precision)  # DDP / FSDP2 in place; before the optimizer sees the parameters


def compile_blocks(model: nn.Module) -> str:
    """Regional torch.compile: each block of `model.layers` compiled on its own, in place
    (nn.Module.compile: parameter names, state_dict keys and the model's hooks are unchanged, so
    checkpoints load either way). Blocks repeat, so dynamo compiles one graph and reuses it; a
    model without blocks (the smoke model) is compiled whole. Applied before DDP / FSDP (as
    torchtitan orders it). Returns what was compiled, for the log."""
    blocks = list(getattr(model, "layers", ()))
    for block in blocks or [model]:
        block.compile()
    return f"torch.compile on each of {len(blocks)} blocks" if blocks else f"torch.compile on the whole {type(model).__name__}"


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, NumPy and torch (all devices) and set, or reset, the determinism switches.

    Called at the start of every job, so jobs sharing a process (a sweep) never inherit each
    other's generator state or determinism flags.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def release_process_state(device: torch.device) -> None:
    """Drop what a finished job leaves behind in the process, so the next job of a sweep run in the
    same process starts as a fresh one would: torch.compile's graphs and guards, the job's objects
    frozen out of the cyclic collector (trainer.freeze_startup_objects: unfrozen, so the collection
    below reaches their reference cycles), cached CUDA blocks and peak-memory stats. (Generators and
    determinism flags are reset by the next seed_everything; writers are closed by the job; Hydra
    reconfigures logging per job.)"""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # imported only once something compiled
        dynamo.reset()
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _model_info(model: nn.Module, cfg: RootConfig, vocab_size: int) -> dict:
    """run.json's model block; activated counts come from models/flops.py for kimi_k3 (MoE), and
    equal the total for the smoke model."""
    total = sum(p.numel() for p in model.parameters())
    activated = parameter_counts(cfg.model, vocab_size)["activated"] if cfg.model.arch == "kimi_k3" else total
    return {"name": cfg.model.name, "arch": cfg.model.arch, "params_total": total, "params_activated": activated}


def _flops_per_token(cfg: RootConfig, vocab_size: int) -> Optional[float]:
    """Training FLOPs per token for MFU; None (no MFU) for the smoke model, which has no FLOPs model."""
    return flops_per_token(cfg.model, vocab_size, cfg.train.seq_len) if cfg.model.arch == "kimi_k3" else None


def _sinks(logger: str, run_dir: Path) -> list:
    from kimik3.runs.tensorboard import TensorBoardSink, tensorboard_available

    if logger == "tensorboard" or (logger == "auto" and tensorboard_available()):
        return [TensorBoardSink(run_dir)]
    return []


def _device_name(device: torch.device, world_size: int) -> str:
    """This rank's device, prefixed by the rank count when there are several (the start summary shows
    only rank 0's line): 'cuda:0 (NVIDIA H200)', '2 ranks x cpu (1 threads)'."""
    name = (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
            else f"cpu ({torch.get_num_threads()} threads)")
    return name if world_size == 1 else f"{world_size} ranks x {name}"


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4f}"


__all__ = ["compile_blocks", "release_process_state", "run", "seed_everything"]
