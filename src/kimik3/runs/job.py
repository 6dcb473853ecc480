"""One Hydra job of kimik3-train: DictConfig -> RootConfig -> validate -> `session.run`, and its failures.

Failures: a job that fails prints one line on stderr ("kimik3-train: error: ..."), leaves
`error.txt` and an "end" event with status failed in its run dir (or, for a single run that failed
before it started, no run dir at all, nor the parents its launch created), and returns None (no
objective) to Hydra instead of raising, so the other jobs of a sweep still run and the Optuna sweeper
records a failed trial (it would abort the whole study on a nan). A run that ends without a finite
objective (it diverged) is such a failure too. The job also appends its line to `launch.failures`;
how main() turns failures into an exit status is in kimik3.train (single runs) and runs/sweep.py
(sweeps).

Ctrl-C (KeyboardInterrupt) ends the job the same way, with status "interrupted", one line saying how
to continue the run, and exit status 130 for the whole command (a sweep stops there); SIGTERM (a
SLURM time limit, torchrun stopping the other ranks, `kill`) likewise, with exit status 143. Under
torchrun every rank exits with that status, and rank 0 alone prints the line and marks the run dir.
A trial of a submitit sweep (hydra/launcher=slurm or submitit_local) runs in a process of its own,
whose result the launching process unpickles: there the interrupted trial returns None like a failed
one instead of exiting (an exit leaves submitit no result, and the launching process would stop in a
traceback before the sweep's accounting), so the sweep names it among its failed trials. Such a
trial also takes submitit's preemption signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL names another),
which SLURM sends `signal_delay_s` before the time limit: submitit's own handler would raise or exit
inside a training step (recorded as a failure, no train.resume named) and requeue the trial from its
start, which the trial dir, already holding the run, refuses. kimik3 stops the trial as for SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kimik3.checkpoint import latest_checkpoint
from kimik3.config.validate import check_known_keys, validate
from kimik3.distributed import configure_rank_logging, read_dist_env
from kimik3.runs import run_dir as rundir
from kimik3.runs.launch import Launch
from kimik3.runs.metrics import MetricsWriter
from kimik3.runs.interrupts import interrupt_cause, raise_terminated
from kimik3.runs.session import run
from kimik3.write_errors import WriteError

EXPECTED_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, WriteError)
"""Bad input (config, data, checkpoint, run dir) or a file that could not be written (a full disk):
reported as one line without a traceback."""
INTERRUPTED_EXIT = {"Ctrl-C": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
"""The exit status of a command stopped by each signal (128 + its number, as a shell reports it)."""
SUBMITIT_PREEMPT_SIGNAL = "SUBMITIT_PREEMPT_SIGNAL"
"""submitit's variable naming its preemption / time-limit signal without the SIG prefix (default USR2)."""


def stop_signals(submitit_trial: bool) -> list[signal.Signals]:
    """The signals that stop a job as interrupted: SIGTERM, and in a submitit trial submitit's
    preemption signal too (see the module docstring)."""
    if not submitit_trial:
        return [signal.SIGTERM]
    name = "SIG" + os.environ.get(SUBMITIT_PREEMPT_SIGNAL, "USR2")
    preempt = getattr(signal.Signals, name, None)
    return [signal.SIGTERM] + ([preempt] if preempt is not None and preempt != signal.SIGTERM else [])


def full_error_wanted() -> bool:
    """Hydra's own switch for full tracebacks (HYDRA_FULL_ERROR=1), honoured by kimik3's one-line errors."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def run_task(dcfg: DictConfig, launch: Launch) -> Optional[float]:
    """The Hydra task function's body: run the job, turn a failure into the module docstring's form."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sessions_before = _session_count(run_dir)
    main_rank = True
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    submitit_trial = in_submitit_trial(hc)
    signals = stop_signals(submitit_trial) if in_main_thread else []
    previous = {signum: signal.signal(signum, raise_terminated) for signum in signals}
    try:
        env = read_dist_env()
        main_rank = env.is_main
        configure_rank_logging(env, run_dir)  # ranks > 0: no train.log lines, no console INFO
        check_known_keys(dcfg)
        cfg = OmegaConf.to_object(dcfg)
        validate(cfg)
        return run(cfg, run_dir, run_id=_run_id(hc, run_dir, launch), overrides=list(hc.overrides.task),
                   resume_here=launch.resume_dir is not None, reproduce_from=launch.reproduce_from)
    except KeyboardInterrupt as e:
        cause = interrupt_cause(e)
        resumable = latest_checkpoint(run_dir) is not None
        line = f"interrupted ({cause})" + (f"; continue with train.resume={run_dir}" if resumable else "")
        if main_rank:  # every rank of a torchrun job gets the signal; one line (and one record) for the job
            print(f"kimik3-train: {line}", file=sys.stderr, flush=True)
            _mark_or_discard(run_dir, hc, line, launch, sessions_before, status="interrupted")
        if submitit_trial:
            launch.failures.append(line)
            return None
        raise SystemExit(INTERRUPTED_EXIT[cause]) from None
    except Exception as e:  # noqa: BLE001 - every failure becomes one line + a marked run dir + nan
        expected = isinstance(e, EXPECTED_ERRORS)
        if not expected or full_error_wanted():
            traceback.print_exc()
        line = str(e).strip() if expected else f"{type(e).__name__}: {e}"
        if isinstance(e, WriteError) and latest_checkpoint(run_dir) is not None:
            line += f"; the checkpoints written before are kept: continue with train.resume={run_dir}"
        print(f"kimik3-train: error: {line}", file=sys.stderr, flush=True)
        launch.failures.append(line)
        if main_rank:
            try:
                _mark_or_discard(run_dir, hc, line, launch, sessions_before)
            except OSError:  # the disk that failed the job refuses error.txt too; the line above says it all
                pass
        return None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def in_submitit_trial(hc: DictConfig) -> bool:
    """Whether this job is a sweep trial that submitit runs in a process of its own (it sets
    SUBMITIT_EXECUTOR there: local or slurm), whose return value is all the launching process gets."""
    return hc.mode == RunMode.MULTIRUN and bool(os.environ.get("SUBMITIT_EXECUTOR"))


def _mark_or_discard(run_dir: Path, hc: DictConfig, line: str, launch: Launch, sessions_before: int,
                     status: str = "failed") -> None:
    """A session that started (run.json has more sessions than `sessions_before`) keeps its run dir,
    marked; one that never started leaves nothing behind (nor the run dir's parents that this launch
    created), except a sweep job, whose dir stays (marked, with an "end" event) so the sweep accounts
    for every job."""
    fresh, started = sessions_before == 0, _session_count(run_dir) > sessions_before
    if started or (fresh and hc.mode == RunMode.MULTIRUN):
        rundir.mark_failed(run_dir, line)
        if not started:
            with MetricsWriter(run_dir) as metrics:
                metrics.log("end", 0, 0, {"status": status, "error": line, "objective": None})
    elif fresh:
        rundir.discard_unstarted(run_dir, run_dir / hc.output_subdir, run_dir / f"{hc.job.name}.log")
        rundir.prune_new_parents(run_dir, Path.cwd(), launch.cwd_entries)
    elif hc.output_subdir != ".hydra":  # a resume in place: drop only this session's Hydra files
        rundir.discard_unstarted(run_dir, run_dir / hc.output_subdir, None)


def _run_id(hc: DictConfig, run_dir: Path, launch: Launch) -> str:
    if launch.resume_dir is not None:
        return rundir.read_manifest(run_dir)["run_id"]
    if hc.mode == RunMode.MULTIRUN:
        return f"{Path(hc.sweep.dir).name}_{hc.sweep.subdir}"
    return run_dir.name


def _session_count(run_dir: Path) -> int:
    return len(rundir.read_manifest(run_dir)["sessions"]) if (run_dir / rundir.MANIFEST).is_file() else 0


__all__ = ["EXPECTED_ERRORS", "INTERRUPTED_EXIT", "full_error_wanted", "in_submitit_trial", "run_task",
           "stop_signals"]
