"""Hyperparameter sweeps: the seeded Optuna sweeper (conf/hydra/sweeper/optuna_seeded.yaml), failed
and diverged trials, no state leaking between the jobs of one process (hydra #2631), joblib
workers, and the sweep reports (kimik3-runs, kimik3-plot) on a real sweep dir.

The sweeps run through `kimik3.train.main()` in this process (Hydra's basic launcher runs every
job here, which is exactly the sharing under test); "the same overrides run alone" is a fresh
interpreter reproducing the trial from its `.hydra/`.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kimik3.runs import plot, report
from kimik3.runs.metrics import read_events
from kimik3.train import main, release_process_state

from recipes import SMOKE  # tests/recipes.py; tests/ is on sys.path

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="needs the [sweep] extra")

SEARCH = ["train.lr=tag(log,interval(1e-4,1e-1))", "train.warmup_steps=choice(1,2)"]
"""Log-uniform lr over three decades (so the plot gets a log axis) and a categorical warmup."""
BASE = [o for o in SMOKE if not o.startswith("train.warmup_steps=")]
"""The tiny smoke recipe minus the swept key (the plugin lets a fixed value win over a search space)."""
TRIAL_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "config_resolved.yaml",
               "run.json", "metrics.jsonl", "train.log")


def kimik3_train_m(monkeypatch, *args: str) -> int:
    """`kimik3-train -m <args>` through main() in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["kimik3-train", "-m", *args])
    try:
        main()
    except SystemExit as e:
        return e.code
    return 0


def run_alone(trial: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """Reproduce a trial in a fresh interpreter: `kimik3-train --config-path <trial>/.hydra --config-name config`."""
    return subprocess.run([sys.executable, "-m", "kimik3.train", "--config-path", str(trial / ".hydra"),
                           "--config-name", "config", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())


def trajectory(run_dir: Path) -> list[tuple[str, int, float]]:
    """Every train loss and val loss of a run, in order: what must match exactly on CPU."""
    return [(e["event"], e["step"], e["loss"] if e["event"] == "train" else e["val_loss"])
            for e in read_events(run_dir) if e["event"] in ("train", "eval")]


def trials(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name))


@pytest.fixture(scope="module")
def optuna_sweep(tmp_path_factory, embedded_data) -> Path:
    """A 4-trial seeded Optuna sweep of the smoke model on the embedded corpus (8 steps a trial)."""
    sweep = tmp_path_factory.mktemp("optuna") / "sweep"
    with pytest.MonkeyPatch.context() as mp:
        code = kimik3_train_m(mp, "hydra/sweeper=optuna_seeded", "hydra.sweeper.n_trials=4", *BASE, *SEARCH,
                              f"hydra.sweep.dir={sweep}")
    assert code == 0
    return sweep


def test_best_trial_is_the_lowest_val_loss_and_every_trial_is_a_complete_run_dir(optuna_sweep):
    results = OmegaConf.load(optuna_sweep / "optimization_results.yaml")
    val_losses = {}
    for trial in trials(optuna_sweep):
        assert all((trial / name).is_file() for name in TRIAL_FILES), sorted(os.listdir(trial))
        assert list((trial / "checkpoints").glob("step-*.pt"))
        events = read_events(trial)
        assert events[0]["event"] == "start" and events[-1]["status"] == "finished"
        assert events[-1]["objective"] == events[-1]["val_loss"]
        val_losses[trial] = events[-1]["val_loss"]
    assert len(val_losses) == 4
    best = min(val_losses, key=val_losses.get)
    assert results.best_value == val_losses[best]
    chosen = OmegaConf.load(best / "config_resolved.yaml").train
    assert results.best_params["train.lr"] == chosen.lr
    assert results.best_params["train.warmup_steps"] == chosen.warmup_steps


@pytest.mark.slow
def test_best_trial_reproduced_alone_gives_the_same_losses(optuna_sweep, tmp_path):
    results = OmegaConf.load(optuna_sweep / "optimization_results.yaml")
    (best,) = [t for t in trials(optuna_sweep) if read_events(t)[-1]["objective"] == results.best_value]
    again = run_alone(best, tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert read_events(tmp_path / "again")[-1]["objective"] == results.best_value
    assert trajectory(tmp_path / "again") == trajectory(best)


@pytest.mark.slow
def test_kth_job_after_a_diverged_one_matches_the_same_overrides_run_alone(monkeypatch, capsys, tmp_path,
                                                                          embedded_data):
    """Job 0 diverges (lr 1e6: huge weights, skipped steps, nan val loss); job 1 shares its process."""
    sweep = tmp_path / "grid"
    code = kimik3_train_m(monkeypatch, *SMOKE, "train.lr=1e6,3e-3", f"hydra.sweep.dir={sweep}")
    err = capsys.readouterr().err
    assert code == 1 and f"1 of 2 trial(s) of the sweep failed: 0 in {sweep}" in err
    diverged, healthy = trials(sweep)
    end = read_events(diverged)[-1]
    assert end["status"] == "failed" and end["objective"] is None and end["val_loss"] is None
    reason = (diverged / "error.txt").read_text()
    assert "train.objective=val_loss is nan after 8 steps" in reason and "the run diverged" in reason
    assert read_events(healthy)[-1]["status"] == "finished"
    alone = run_alone(healthy, tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr
    assert trajectory(tmp_path / "alone") == trajectory(healthy)


def test_optuna_sweep_whose_trials_all_fail_ends_in_one_line(monkeypatch, capsys, tmp_path, embedded_data):
    """Optuna has no best trial to report then (it raised "No trials are completed yet." through
    Hydra's traceback); the sweep ends like any other failed sweep: one line naming the trials, exit 1."""
    sweep = tmp_path / "all_failed"
    code = kimik3_train_m(monkeypatch, "hydra/sweeper=optuna_seeded", "hydra.sweeper.n_trials=2", *BASE,
                          "train.warmup_steps=choice(-1,-2)", f"hydra.sweep.dir={sweep}")
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"kimik3-train: error: 2 of 2 trial(s) of the sweep failed: 0, 1 in {sweep} "
                                    "(the reason is in each trial's error.txt or train.log)")
    assert "train.warmup_steps=-1 must be >= 0" in (sweep / "0" / "error.txt").read_text()
    assert not (sweep / "optimization_results.yaml").exists()


def test_seeded_sampler_proposes_the_same_trials_and_survives_failed_ones(tmp_path):
    """The real plugin with our config and a fake launcher, past TPE's 10 random startup trials;
    a trial that returns no objective (what a failed kimik3 job returns) is recorded as FAIL."""
    from hydra import compose, initialize_config_dir
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.utils import instantiate

    from kimik3.config.store import register_configs
    from kimik3.runs.run_dir import register_resolvers
    from kimik3.train import CONF_DIR, CONFIG_NAME

    class Launcher:
        """Objective = distance of log10(lr) from -2.5; warmup 2 'fails' (returns None)."""

        def __init__(self) -> None:
            self.launched: list[tuple[str, ...]] = []

        def launch(self, batch, initial_job_idx):
            self.launched += batch
            returns = []
            for overrides in batch:
                values = dict(o.split("=") for o in overrides)
                ret = JobReturn(status=JobStatus.COMPLETED, overrides=list(overrides))
                ret.return_value = (None if values["train.warmup_steps"] == "2"
                                    else abs(math.log10(float(values["train.lr"])) + 2.5))
                returns.append(ret)
            return returns

    register_configs()
    register_resolvers()

    def sweep(name: str) -> tuple[list, dict]:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
            cfg = compose(CONFIG_NAME, overrides=["hydra/sweeper=optuna_seeded", "hydra.sweeper.n_trials=14",
                                                  f"hydra.sweep.dir={tmp_path / name}"], return_hydra_config=True)
        assert cfg.hydra.sweeper.sampler.seed == 1337 and cfg.hydra.sweeper.direction == "minimize"
        sweeper = instantiate(cfg.hydra.sweeper).sweeper
        sweeper.config, sweeper.launcher, sweeper.hydra_context = cfg, Launcher(), object()
        (tmp_path / name).mkdir()  # a real launcher creates the sweep dir
        sweeper.sweep(list(SEARCH))
        return sweeper.launcher.launched, OmegaConf.to_container(
            OmegaConf.load(tmp_path / name / "optimization_results.yaml"))

    first, results = sweep("a")
    second, _ = sweep("b")
    assert first == second and len(first) == 14 and len(set(first)) == 14
    assert any("train.warmup_steps=2" in t for t in first)  # failed trials did not stop the study
    assert results["best_params"]["train.warmup_steps"] == 1
    assert results["best_value"] == min(abs(math.log10(float(dict(o.split("=") for o in t)["train.lr"])) + 2.5)
                                        for t in first if "train.warmup_steps=1" in t)


def test_kimik3_runs_ranks_trials_and_stars_the_best(optuna_sweep, capsys):
    results = OmegaConf.load(optuna_sweep / "optimization_results.yaml")
    assert report.main([str(optuna_sweep), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    objectives = [r["objective"] for r in records]
    assert len(records) == 4 and objectives == sorted(objectives) and objectives[0] == results.best_value
    assert [r["best"] for r in records] == [True, False, False, False]
    assert all(any(o.startswith("train.lr=") for o in r["overrides"]) for r in records)
    assert report.main([str(optuna_sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    first_row = lines[next(i for i, line in enumerate(lines) if line.startswith("run ")) + 1]
    assert first_row.startswith(f"{records[0]['name']} *")
    assert lines[-1].startswith(f"optimization_results.yaml: best_value={results.best_value}")


def test_kimik3_plot_draws_objective_vs_lr_on_a_log_axis(optuna_sweep, tmp_path):
    pytest.importorskip("matplotlib")
    fig = plot.plot_sweep(plot.expand_runs([optuna_sweep]), "train.lr")
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_ylabel() == "objective"
    points, best = ax.lines
    assert len(points.get_xdata()) == 4
    results = OmegaConf.load(optuna_sweep / "optimization_results.yaml")
    assert list(best.get_xdata()) == [results.best_params["train.lr"]]
    assert list(best.get_ydata()) == [results.best_value]
    assert plot.main([str(optuna_sweep), "--x", "train.lr", "--out", str(tmp_path / "sweep.png")]) == 0
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_joblib_workers_run_trials_in_parallel_with_one_thread_each(monkeypatch, capsys, tmp_path, embedded_data):
    """Three jobs, two workers: loky caps each worker's torch threads (cores // n_jobs), so the workers
    together use no more threads than there are cores (run.json records the count). The diverged
    trial fails in its worker, the others still run, and the sweep exits 1 naming it, as it does
    under the basic launcher (test_kth_job_after_a_diverged_one_...)."""
    joblib = pytest.importorskip("joblib", reason="needs the [sweep] extra")
    sweep = tmp_path / "joblib"
    code = kimik3_train_m(monkeypatch, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *SMOKE,
                          "train.lr=1e-3,1e6,3e-3", f"hydra.sweep.dir={sweep}")
    assert code == 1 and capsys.readouterr().err.splitlines()[-1] == (
        f"kimik3-train: error: 1 of 3 trial(s) of the sweep failed: 1 in {sweep} "
        "(the reason is in each trial's error.txt or train.log)")
    assert "the run diverged" in (sweep / "1" / "error.txt").read_text()
    for trial in trials(sweep):
        assert read_events(trial)[-1]["status"] == ("failed" if trial.name == "1" else "finished")
        device = json.loads((trial / "run.json").read_text())["sessions"][0]["device"]
        threads = int(re.fullmatch(r"cpu \((\d+) threads\)", device).group(1))
        assert 2 * threads <= max(2, joblib.cpu_count()), device


def test_release_process_state_drops_compiled_graphs():
    """A function compiled in one job is compiled again in the next (dynamo caches do not carry over)."""
    import torch._dynamo

    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    graphs = torch._dynamo.utils.counters["stats"]
    f(torch.ones(3))
    before = graphs["unique_graphs"]
    f(torch.ones(3))
    assert graphs["unique_graphs"] == before  # cached
    release_process_state(torch.device("cpu"))
    f(torch.ones(3))
    assert graphs["unique_graphs"] == before + 1
