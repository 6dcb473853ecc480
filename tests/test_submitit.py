"""Sweeps through hydra-submitit-launcher's local executor (`hydra/launcher=submitit_local`).

The local executor runs each trial in a process of its own through the same submitit machinery as
the SLURM launcher (conf/hydra/launcher/slurm.yaml): the task function pickled, one job submitted per
trial, its result unpickled by the launching process, logs under `<sweep>/.submitit/<job id>/`. No
SLURM cluster is needed, so this is the SLURM path's end-to-end test on one machine; what it cannot
show is the SLURM rank mapping (tests/distributed/test_env.py).

The trial that gets a signal plays a SLURM job at its time limit: submitit has SLURM send its
preemption signal (SIGUSR2) shortly before the limit, and SLURM sends SIGTERM at it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import OmegaConf

from kimik3.runs import report
from kimik3.runs.metrics import read_events

from recipes import SMOKE  # tests/recipes.py; tests/ is on sys.path

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs pip install 'kimik3[slurm]'")

TRIAL_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "config_resolved.yaml",
               "run.json", "metrics.jsonl", "train.log")
SHORT = [o for o in SMOKE if not o.startswith("train.max_steps=")] + ["train.checkpoint_interval=2"]
"""The smoke recipe with checkpoints every 2 steps, its length left to the sweep."""


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll `condition` until it holds (the trials run in processes of their own)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def last_event(trial: Path, event: str) -> bool:
    """Whether `trial` has logged an `event` event yet."""
    return (trial / "metrics.jsonl").is_file() and any(e["event"] == event for e in read_events(trial))


def job_id(trial: Path) -> str:
    """The trial's submitit job id, which Hydra records as hydra.job.id in its .hydra/hydra.yaml."""
    return str(OmegaConf.load(trial / ".hydra" / "hydra.yaml").hydra.job.id)


def trial_process(trial: Path) -> int:
    """The pid of the process that runs `trial`: the child of the submitit controller, whose pid is the
    local executor's job id."""
    controller = int(job_id(trial))
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
        if ppid == controller:
            children.append(int(stat.parent.name))
    assert len(children) == 1, f"submitit controller {controller} runs {children}"
    return children[0]


def sweep_with_a_signal(tmp_path: Path, signum: int) -> tuple[Path, str]:
    """Run `kimik3-train -m hydra/launcher=submitit_local` in `tmp_path` with two trials: trial 0 (8
    steps) finishes, trial 1 (endless) gets `signum` after its first checkpoint. Checks what any such
    sweep must show and returns (sweep dir, stdout + stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "kimik3.train", "-m", "hydra/launcher=submitit_local", *SHORT,
                             "train.max_steps=8,100000"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        wait_for(lambda: any((tmp_path / "multirun").glob("*/1/metrics.jsonl")), "trial 1 to start")
        sweep = next((tmp_path / "multirun").iterdir())
        wait_for(lambda: last_event(sweep / "0", "end") and last_event(sweep / "1", "checkpoint"),
                 "trial 0 to end and trial 1 to checkpoint")
        os.kill(trial_process(sweep / "1"), signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.splitlines()[-1] == (f"kimik3-train: error: 1 of 2 trial(s) of the sweep failed: 1 in {sweep} "
                                    "(the reason is in each trial's error.txt or train.log)"), err
    assert os.listdir(tmp_path) == ["multirun"]  # nothing of submitit's in the working directory
    assert {p.name for p in sweep.iterdir()} == {"0", "1", ".submitit", "multirun.yaml"}
    assert all((sweep / "0" / f).is_file() for f in TRIAL_FILES)
    assert read_events(sweep / "0")[-1]["status"] == "finished"
    assert (sweep / "0" / "checkpoints" / "step-000008.pt").is_file()
    session = OmegaConf.load(sweep / "0" / "run.json")["sessions"][0]  # no SLURM_* variables: one rank
    assert session["launcher"] == "none" and session["world_size"] == 1
    return sweep, out + err


def submitit_log(trial: Path, stream: str) -> str:
    """The trial's submitit log (`out` or `err`): <sweep>/.submitit/<job id>/<job id>_0_log.<stream>."""
    job = job_id(trial)
    return (trial.parent / ".submitit" / job / f"{job}_0_log.{stream}").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the trial's process in /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2], ids=lambda s: s.name)
def test_submitit_local_sweep_accounts_a_trial_stopped_by_the_time_limit_signals(signum, tmp_path, embedded_data):
    """Trial 1 gets a time-limit signal: it is recorded as interrupted with the way on (train.resume),
    the launching process collects both results and exits 1 with the one line naming trial 1, as
    under any launcher; submitit's files stay in the sweep dir, where kimik3-runs and the failure
    accounting do not mistake them for a trial."""
    sweep, _ = sweep_with_a_signal(tmp_path, signum)
    name = signal.Signals(signum).name
    end = read_events(sweep / "1")[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["error"] == f"interrupted ({name})"
    assert (sweep / "1" / "error.txt").read_text().endswith(
        f" interrupted ({name}); continue with train.resume={sweep / '1'}\n")
    assert OmegaConf.load(sweep / "1" / "run.json")["sessions"][-1]["status"] == "interrupted"
    assert f"kimik3-train: interrupted ({name})" in submitit_log(sweep / "1", "err")  # the trial's own line
    runs = report.load_runs(sweep)  # kimik3-runs: the two trials, nothing from .submitit/
    assert sorted((r.name, r.status) for r in runs) == [("0", "finished"), ("1", "interrupted")]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the trial's process in /proc")
def test_submitit_local_sweep_accounts_a_trial_whose_process_was_killed(tmp_path, embedded_data):
    """Trial 1 is killed (SIGKILL: an out-of-memory kill, a lost node) and leaves submitit no result:
    the sweep still ends in the one line naming it (its dir has no end event), with no traceback,
    and the launching process's log points at the trial's submitit log."""
    sweep, output = sweep_with_a_signal(tmp_path, signal.SIGKILL)
    assert "Traceback" not in output, output
    job = job_id(sweep / "1")
    assert f"submitit job {job} ended without a result (its process was killed?); its logs are in " \
           f"{sweep / '.submitit' / job}" in output
    assert read_events(sweep / "1")[-1]["event"] != "end" and not (sweep / "1" / "error.txt").exists()
    assert "checkpoint step" in submitit_log(sweep / "1", "out")
