"""Accounting for the trials of a sweep after it ran, whichever launcher ran them.

Every trial of a sweep runs to its end on its own: a failed or diverged trial returns no objective
to the sweeper and the others go on (runs/job.py). Whether the sweep as a whole succeeded is then
read from the trial dirs, not from the process that ran them: Hydra's basic launcher runs every
trial in kimik3-train's own process, but hydra-joblib-launcher runs them in worker processes, and
the submitit (SLURM) launcher on other machines, so nothing they record in memory reaches main().

`SweepDirs` is a Hydra callback (conf/train.yaml, `hydra.callbacks.kimik3_sweep`): after a
multirun, in the launching process, it records the sweep dir. main() then calls `failed_trials` on
it and exits 1 with one line naming the failed trials.

One launcher does not get that far on its own: hydra-submitit-launcher (hydra/launcher=slurm or
submitit_local) collects each trial's pickled result, and a trial whose process died without one
(SIGKILL, an out-of-memory kill, a lost node) raised submitit's UncompletedJobError in the launching
process, a traceback before the other trials were collected. `tolerate_submitit_trials_without_a_result`
makes such a trial return no objective, as a failed kimik3 trial does, naming its submitit log; its
dir, without an "end" event, is then counted as failed.

One sweeper does not get that far on its own either: when no trial of a study completed, the Optuna
sweeper asks Optuna for the best trial and raises ("No trials are completed yet."), which Hydra
prints as a traceback. `tolerate_studies_without_a_completed_trial` lets such a sweep end normally
(no optimization_results.yaml) when the trial dirs confirm that every trial failed, so the sweep
ends in the same one line as under any other sweeper.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kimik3.runs.metrics import read_events
from kimik3.runs.run_dir import ERROR_FILE

log = logging.getLogger("kimik3")

_finished: list[Path] = []
"""Sweep dirs finished in this process since the last `take_finished_sweeps` (see SweepDirs)."""


class SweepDirs(Callback):
    """Records each finished multirun's sweep dir for main() (Hydra instantiates this from the config)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Here, not earlier: Hydra's plugin scan re-executes the plugin modules (a patch made before it is lost).
        tolerate_studies_without_a_completed_trial()
        tolerate_submitit_trials_without_a_result()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _finished.append(Path(str(config.hydra.sweep.dir)).resolve())


def take_finished_sweeps() -> list[Path]:
    """The sweep dirs recorded since the last call (main() calls it once per command line)."""
    taken = list(_finished)
    _finished.clear()
    return taken


def trial_dirs(sweep_dir: Path) -> list[Path]:
    """The trial dirs of a sweep dir: its subdirs that Hydra or kimik3 wrote a job into."""
    markers = (".hydra", "metrics.jsonl", ERROR_FILE)
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and any((p / m).exists() for m in markers)]
    return sorted(found, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def failed_trials(sweep_dir: Path) -> tuple[list[Path], int]:
    """(failed trial dirs, number of trials). A trial failed unless its last event is an "end"
    whose status is not "failed": a marked failure (error.txt, objective None: a bad config, a
    diverged run) and a trial whose process died before it could say so both count."""
    trials = trial_dirs(sweep_dir)
    return [t for t in trials if not _succeeded(t)], len(trials)


def failure_line(sweep_dir: Path, failed: list[Path], total: int) -> str:
    """One line naming the failed trials of `sweep_dir`."""
    names = ", ".join(p.name for p in failed)
    return (f"{len(failed)} of {total} trial(s) of the sweep failed: {names} in {sweep_dir} "
            f"(the reason is in each trial's {ERROR_FILE} or train.log)")


def tolerate_studies_without_a_completed_trial() -> None:
    """Wrap the Optuna sweeper's `sweep` (once per process; a no-op without the [sweep] extra) so a
    study whose trials all failed returns instead of raising: Optuna has no best trial to name, and
    main() reports the failed trials from their dirs. Any other error, or one raised while some
    trial succeeded, still propagates."""
    try:
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
    except ImportError:
        return
    _wrap_once(OptunaSweeper, "sweep", _tolerant)


def tolerate_submitit_trials_without_a_result() -> None:
    """Wrap hydra-submitit-launcher's `launch` (once per process; a no-op without the [slurm] extra) so a
    trial that left no result (see the module docstring) is collected as a trial without an objective;
    an error the trial raised itself, which submitit pickles as its result, still propagates."""
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
    except ImportError:
        return
    _wrap_once(BaseSubmititLauncher, "launch", _collecting_trials_without_a_result)


def _wrap_once(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace `owner.name` by `wrap(owner.name)` unless it is wrapped already (the wrappers mark
    themselves `_kimik3_tolerant`): every multirun of a process calls this."""
    if not getattr(getattr(owner, name), "_kimik3_tolerant", False):
        setattr(owner, name, wrap(getattr(owner, name)))


def _collecting_trials_without_a_result(launch: Callable[..., Any]) -> Callable[..., Any]:
    """`launch`, with submitit's Job.results answering no objective for a job that left no result while
    it runs (the launcher calls it once per job, in this process, after submitting them all)."""

    @functools.wraps(launch)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        from submitit.core.core import Job

        results = Job.results
        Job.results = _no_objective_without_a_result(results)
        try:
            return launch(self, *args, **kwargs)
        finally:
            Job.results = results

    wrapped._kimik3_tolerant = True  # type: ignore[attr-defined]
    return wrapped


def _no_objective_without_a_result(results: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    """Job.results, returning one completed JobReturn without a value where the job left no result."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import UncompletedJobError

    def job_results(job: Any) -> list[Any]:
        try:
            return results(job)
        except UncompletedJobError:
            log.error(f"submitit job {job.job_id} ended without a result (its process was killed?); "
                      f"its logs are in {job.paths.folder}")
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=None)]

    return job_results


def _tolerant(sweep: Callable[..., None]) -> Callable[..., None]:
    """`sweep`, returning None where it raised a ValueError after every trial of its sweep dir failed."""

    @functools.wraps(sweep)
    def wrapped(self: Any, arguments: list[str]) -> None:
        try:
            return sweep(self, arguments)
        except ValueError:
            sweep_dir = Path(str(self.sweeper.config.hydra.sweep.dir))
            failed, total = failed_trials(sweep_dir) if sweep_dir.is_dir() else ([], 0)
            if total == 0 or len(failed) < total:
                raise
            log.warning(f"no trial of the Optuna study completed ({total} failed): no optimization_results.yaml")

    wrapped._kimik3_tolerant = True  # type: ignore[attr-defined]
    return wrapped


def _succeeded(trial: Path) -> bool:
    if (trial / ERROR_FILE).is_file():
        return False
    try:
        events = read_events(trial)
    except OSError:  # read_events drops unparsable lines itself
        return False
    return bool(events) and events[-1]["event"] == "end" and events[-1].get("status") != "failed"


__all__ = ["SweepDirs", "failed_trials", "failure_line", "take_finished_sweeps", "tolerate_studies_without_a_completed_trial",
           "tolerate_submitit_trials_without_a_result", "trial_dirs"]
