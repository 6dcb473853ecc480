"""Fixture run dirs in the run-dir contract's format (Hydra output dir + run.json + metrics.jsonl).

The trainer writes these for real; tests of the readers (report, plot) build them by hand so each
case (crashed, resumed, failed trial, torn last line) is explicit and fast.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest
from omegaconf import OmegaConf

TOKENS_PER_STEP = 1024


def write_run(run_dir: Path, *, overrides: Sequence[str] = (), model: str = "smoke",
              lr: float = 1e-3, losses: Sequence[float] = (4.0, 3.5, 3.0),
              val_losses: Sequence[float] = (3.2,), status: Optional[str] = "finished",
              age_s: float = 0.0, created: str = "2026-01-01T00:00:00", multirun: bool = False
              ) -> Path:
    """A run dir: one train event per loss, evals spread over the run, an end event with `status`
    (None: no end event, as a live or crashed run); files dated `age_s` seconds ago; `multirun`
    marks it a sweep trial in .hydra/hydra.yaml, as Hydra does."""
    run_dir = Path(run_dir)
    (run_dir / ".hydra").mkdir(parents=True)
    config = {"model": {"name": model, "arch": "smoke_test_lm"},
              "train": {"lr": lr, "warmup_steps": 10, "max_steps": len(losses)}}
    OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), run_dir / ".hydra" / "overrides.yaml")
    # Hydra leaves interpolations unresolved here, e.g. ${kimik3.run_id:}, unknown to a reader.
    hydra = {"hydra": {"mode": "MULTIRUN" if multirun else "RUN",
                       "sweep": {"dir": "multirun/${kimik3.run_id:}"}}}
    OmegaConf.save(OmegaConf.create(hydra), run_dir / ".hydra" / "hydra.yaml")
    manifest = {"format": 1, "run_id": f"id-{run_dir.name}", "created": created,
                "model": {"name": model, "arch": "smoke_test_lm", "params_total": 1000,
                          "params_activated": 1000},
                "dataset": {}, "config_hash": "0", "overrides": list(overrides), "sessions": []}
    (run_dir / "run.json").write_text(json.dumps(manifest))

    now = time.time() - age_s
    events = [_event("start", 0, now)]
    eval_every = max(len(losses) // max(len(val_losses), 1), 1)
    val_iter = iter(val_losses)
    for i, loss in enumerate(losses, start=1):
        events.append(_event("train", i, now, loss=loss, lr=lr * i / len(losses), grad_norm=1.0,
                             tokens_per_s=5000.0 + i, skipped=0, **{"moe/layer1/load_max": 1.5}))
        if i % eval_every == 0 and (val := next(val_iter, None)) is not None:
            events.append(_event("eval", i, now, val_loss=val))
    if status is not None:
        final_val = val_losses[-1] if val_losses else None
        events.append(_event("end", len(losses), now, status=status, val_loss=final_val,
                             train_loss=losses[-1], objective=final_val))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    os.utime(run_dir / "run.json", (now, now))
    os.utime(run_dir / "metrics.jsonl", (now, now))
    return run_dir


def write_sweep(sweep_dir: Path, lrs: Sequence[float], objectives: Sequence[Optional[float]],
                *, optuna: bool = False) -> Path:
    """A Hydra multirun dir: one trial subdir per lr (objective None: failed) and the basic
    sweeper's multirun.yaml, or with `optuna` the Optuna sweeper's optimization_results.yaml."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True)
    if not optuna:
        (sweep_dir / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    for i, (lr, objective) in enumerate(zip(lrs, objectives)):
        write_run(sweep_dir / str(i), overrides=["model=smoke", f"train.lr={lr}"], lr=lr,
                  multirun=True, losses=(4.0, 3.6, (objective or 9.0) + 0.1),
                  val_losses=(objective,) if objective is not None else (),
                  status="finished" if objective is not None else "failed")
    if optuna:
        best = min((o, lr) for o, lr in zip(objectives, lrs) if o is not None)
        results = {"name": "optuna", "best_params": {"train.lr": best[1]}, "best_value": best[0]}
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
    return sweep_dir


def _event(kind: str, step: int, time_s: float, **fields) -> dict:
    return {"event": kind, "step": step, "tokens": step * TOKENS_PER_STEP, "time": time_s,
            "elapsed": float(step), **fields}


@pytest.fixture
def make_run():
    return write_run


@pytest.fixture
def make_sweep():
    return write_sweep
