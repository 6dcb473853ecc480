"""kimik3-train (also `python -m kimik3.train`): the Hydra app that composes a recipe and runs it.

Flow: main() plans the command line (reproduce / resume rewriting, early config errors; see
runs/launch.py) -> Hydra composes conf/ with the dataclass schemas -> the task function turns the
DictConfig into a RootConfig, validates it and calls `run(cfg, ...)`, which builds data, model and
optimizer, opens the run dir and hands everything to `trainer.train`.

Failures: a job that fails prints one line on stderr ("kimik3-train: error: ..."), leaves
`error.txt` and an "end" event with status failed in its run dir (or, for a single run that failed
before it started, no run dir at all), and returns None (no objective) to Hydra instead of raising,
so the other jobs of a sweep still run and the Optuna sweeper records a failed trial (it would
abort the whole study on a nan). A run that ends without a finite objective (it diverged) is such a
failure too. main() exits 1 when any job of the process failed.

Sweeps: Hydra's basic launcher runs every job in this one process, and a joblib worker runs several
in turn, so each job starts from `seed_everything` and ends with `release_process_state` (hydra #2631).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import sys
import traceback
from pathlib import Path
from typing import Optional

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kimik3.checkpoint import (
    CheckpointError,
    capture_rng,
    check_compatible,
    checkpoint_path,
    recipe_of,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from kimik3.config.schema import RootConfig
from kimik3.config.store import register_configs
from kimik3.config.validate import check_known_keys, resolve_device, resolve_precision, validate, validate_vocab
from kimik3.data import ShardedTokenDataset, TokenDataLoader, prepare_data
from kimik3.distributed import (DistContext, NullMetrics, configure_rank_logging, hydra_rank_overrides, parallelize,
                                read_dist_env, setup_distributed, teardown_distributed)
from kimik3.distributed.dcp import (load_weights, read_resume_payload, rebase_loader_state, save_sharded,
                                    sharded_checkpoint_path)
from kimik3.models import build_model
from kimik3.models.flops import flops_per_token, parameter_counts
from kimik3.optim import build_optimizer
from kimik3.runs import run_dir as rundir
from kimik3.runs.launch import Launch, plan_launch
from kimik3.runs.metrics import MetricsWriter, peak_flops
from kimik3.runs.profile import StepProfiler
from kimik3.runs.progress import Progress
from kimik3.runs.summary import format_summary
from kimik3.trainer import Throughput, TrainState, planned_steps, train

log = logging.getLogger("kimik3")

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The repo's conf/ (src layout: src/kimik3/train.py -> <repo>/conf); the package is installed editable."""
CONFIG_NAME = "train"
EXPECTED_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)
"""Bad input (config, data, checkpoint, run dir): reported as one line without a traceback."""


def main() -> None:
    """Console entry point: plan the command line, run the Hydra app, exit 1 if any job failed."""
    register_configs()
    rundir.register_resolvers()
    if not CONF_DIR.is_dir():
        _exit(f"config dir {CONF_DIR} not found: install kimik3 from its source checkout (pip install -e .)")
    try:
        launch = plan_launch(sys.argv[1:], CONF_DIR, CONFIG_NAME)
        launch.argv += hydra_rank_overrides(read_dist_env())  # torchrun ranks > 0 write no .hydra/
    except EXPECTED_ERRORS as e:
        _exit(str(e))

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
    def task(dcfg: DictConfig) -> Optional[float]:
        return run_task(dcfg, launch)

    sys.argv = [sys.argv[0], *launch.argv]
    task()
    if launch.failures and launch.multirun:
        _exit(f"{len(launch.failures)} job(s) of the sweep failed (see error.txt in their run dirs)")
    if launch.failures:
        sys.exit(1)  # the job already printed its line


def run_task(dcfg: DictConfig, launch: Launch) -> Optional[float]:
    """One Hydra job: DictConfig -> RootConfig -> validate -> run; failures follow the module docstring."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sessions_before = _session_count(run_dir)
    main_rank = True
    try:
        env = read_dist_env()
        main_rank = env.is_main
        configure_rank_logging(env, run_dir)  # ranks > 0: no train.log lines, no console INFO
        check_known_keys(dcfg)
        cfg = OmegaConf.to_object(dcfg)
        validate(cfg)
        return run(cfg, run_dir, run_id=_run_id(hc, run_dir, launch), overrides=list(hc.overrides.task),
                   resume_here=launch.resume_dir is not None, reproduce_from=launch.reproduce_from)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one line + a marked run dir + nan
        expected = isinstance(e, EXPECTED_ERRORS)
        if not expected or os.environ.get("HYDRA_FULL_ERROR") == "1":  # Hydra's own switch for full traces
            traceback.print_exc()
        line = str(e).strip() if expected else f"{type(e).__name__}: {e}"
        print(f"kimik3-train: error: {line}", file=sys.stderr, flush=True)
        launch.failures.append(line)
        if main_rank:
            _mark_or_discard(run_dir, hc, line, fresh=sessions_before == 0,
                             started=_session_count(run_dir) > sessions_before)
        return None


def _mark_or_discard(run_dir: Path, hc: DictConfig, line: str, *, fresh: bool, started: bool) -> None:
    """A session that started keeps its run dir, marked; one that never started leaves nothing
    behind, except a sweep job, whose dir stays (marked, with an "end" event) so the sweep
    accounts for every job."""
    if started or (fresh and hc.mode == RunMode.MULTIRUN):
        rundir.mark_failed(run_dir, line)
        if not started:
            with MetricsWriter(run_dir) as metrics:
                metrics.log("end", 0, 0, {"status": "failed", "error": line, "objective": None})
    elif fresh:
        rundir.discard_unstarted(run_dir, run_dir / hc.output_subdir, run_dir / f"{hc.job.name}.log")
    elif hc.output_subdir != ".hydra":  # a resume in place: drop only this session's Hydra files
        rundir.discard_unstarted(run_dir, run_dir / hc.output_subdir, None)


def run(cfg: RootConfig, run_dir: Path, *, run_id: str, overrides: list[str] = (), resume_here: bool = False,
        reproduce_from: Optional[Path] = None, tty: Optional[bool] = None) -> float:
    """Train `cfg` (already validated) into `run_dir`; returns the objective (train.objective).

    Tests call this without Hydra. `resume_here`: the run dir holds the run being resumed.
    `reproduce_from`: a run dir whose resolved recipe must equal `cfg`. Under torchrun (or the
    SLURM launcher) every rank calls it; rank 0 alone writes the run dir (kimik3.distributed).
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
        rundir.compare_recipes(_saved_recipe(reproduce_from), rundir.config_dict(cfg), str(reproduce_from))
    if ctx.is_main:
        rundir.check_new_or_resuming(run_dir, resume_here)
    device = ctx.device
    precision = resolve_precision(t.precision, device)
    seed_everything(t.seed, t.deterministic)

    data_path = prepare_data(cfg.data)
    train_ds, val_ds = ShardedTokenDataset(data_path, "train"), ShardedTokenDataset(data_path, "val")
    validate_vocab(cfg.model, train_ds.vocab_size, str(data_path))
    train_loader = TokenDataLoader(train_ds, t.batch_size, t.seq_len, rank=ctx.rank, world_size=ctx.world_size)
    val_loader = TokenDataLoader(val_ds, t.batch_size, t.seq_len, rank=ctx.rank, world_size=ctx.world_size)
    with device:  # create and initialise parameters on the device: ~1 s for 3B on a GPU, ~20 s on host cores
        model = build_model(cfg.model, train_ds.vocab_size)
    if cfg.model.init_from is not None and t.resume is None:  # kimik3.hf: checked, weights only (a resume has its own)
        from kimik3.hf import load_initial_weights  # needs the [hf] extra (safetensors): imported only when used

        log.info("model.init_from: %s", load_initial_weights(model, cfg.model, cfg.model.init_from))
    model = parallelize(model, ctx, precision)  # DDP / FSDP2 in place; before the optimizer sees the parameters
    optimizer, groups = build_optimizer(model, t)
    recipe = recipe_of(rundir.config_dict(cfg.model), train_ds.vocab_size, train_ds.identity,
                       rundir.config_dict(t), world_size=ctx.world_size)

    state, rng, resumed_from = TrainState(), None, None
    if t.resume is not None:
        resumed_from = resolve_resume(t.resume)
        payload = read_resume_payload(resumed_from, ctx.rank)  # a .pt file or a DCP dir, saved at any world size
        check_compatible(payload["recipe"], recipe, resumed_from)
        if resume_here and payload["run_id"] != rundir.read_manifest(run_dir)["run_id"]:
            raise CheckpointError(f"{resumed_from} belongs to run {payload['run_id']!r}, not to the run in {run_dir}")
        load_weights(resumed_from, payload, model, optimizer, ctx)
        for loader, saved in ((train_loader, payload["loaders"]["train"]), (val_loader, payload["loaders"]["val"])):
            loader.load_state_dict(rebase_loader_state(saved, t.batch_size, ctx.world_size))
        state.load_state_dict(payload["train_state"])
        rng = payload["rng"]

    def save(s: TrainState) -> Path:
        meta = {"run_id": run_id, "recipe": recipe, "config": rundir.config_dict(cfg), "train_state": s.state_dict(),
                "loaders": {"train": train_loader.state_dict(), "val": val_loader.state_dict()}}
        if ctx.parallel != "none":  # collective: every rank writes its shards
            return save_sharded(sharded_checkpoint_path(checkpoint_path(run_dir, s.step)), model, optimizer, meta, ctx)
        return save_checkpoint(checkpoint_path(run_dir, s.step), {
            **meta, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng()})

    peak = peak_flops(device)
    info = _model_info(model, cfg, train_ds.vocab_size)
    session = {"resumed_from": str(resumed_from) if resumed_from else None, "world_size": ctx.world_size,
               "parallel": ctx.parallel, "launcher": ctx.env.launcher,
               "torch_version": torch.__version__, "device": _device_name(device), "precision": precision,
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
        if resumed_from is not None:
            metrics.log("resume", state.step, state.tokens, {"from": str(resumed_from)})
        tokens_per_step = train_loader.tokens_per_step * t.grad_accum_steps
        log.info(format_summary(cfg, run_id=run_id, run_dir=run_dir, info=info, device=session["device"],
                                precision=precision, groups=groups, train_ds=train_ds, val_ds=val_ds,
                                steps=planned_steps(t, tokens_per_step), tokens_per_step=tokens_per_step,
                                start_step=state.step, resumed_from=resumed_from))
        progress = Progress(planned_steps(t, tokens_per_step), state.step, tty=tty if ctx.is_main else False)
        if t.profile.enabled and ctx.is_main:
            profiler = StepProfiler(t.profile, run_dir / "profile", device, state.step)
        if rng is not None:
            restore_rng(rng)
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
        metrics.log("end", state.step, state.tokens, {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                                      "val_loss": state.val_loss, "train_loss": state.train_loss,
                                                      "objective": None})
        raise
    finally:
        for part in (profiler, progress, metrics):
            if part is not None:
                part.close()
        if ctx.is_main:
            rundir.end_session(run_dir, status, state.step)


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
    same process starts as a fresh one would: torch.compile's graphs and guards, cached CUDA blocks
    and peak-memory stats. (Generators and determinism flags are reset by the next seed_everything;
    writers are closed by the job; Hydra reconfigures logging per job.)"""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # imported only once something compiled
        dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _run_id(hc: DictConfig, run_dir: Path, launch: Launch) -> str:
    if launch.resume_dir is not None:
        return rundir.read_manifest(run_dir)["run_id"]
    if hc.mode == RunMode.MULTIRUN:
        return f"{Path(hc.sweep.dir).name}_{hc.sweep.subdir}"
    return run_dir.name


def _saved_recipe(run: Path) -> dict:
    """The resolved recipe of a run: its config_resolved.yaml, else Hydra's saved config.yaml
    merged onto the schema (which also rejects keys the schema no longer has)."""
    resolved = run / rundir.RESOLVED_CONFIG
    source = resolved if resolved.is_file() else run / ".hydra" / "config.yaml"
    merged = OmegaConf.merge(OmegaConf.structured(RootConfig), OmegaConf.load(source))
    return rundir.config_dict(OmegaConf.to_object(merged))


def _session_count(run_dir: Path) -> int:
    return len(rundir.read_manifest(run_dir)["sessions"]) if (run_dir / rundir.MANIFEST).is_file() else 0


def _model_info(model: torch.nn.Module, cfg: RootConfig, vocab_size: int) -> dict:
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


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _exit(line: str) -> None:
    print(f"kimik3-train: error: {line}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
