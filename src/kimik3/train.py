"""kimik3-train (also `python -m kimik3.train`): the Hydra app that composes a recipe and runs it.

Flow: main() plans the command line (reproduce / resume rewriting, early config errors;
runs/launch.py) -> Hydra composes conf/ with the dataclass schemas -> each job (runs/job.py) turns
its DictConfig into a validated RootConfig and runs one training session (runs/session.py: data,
model, optimizer, resume, run dir, trainer).

Exit status: 1 when a single run failed (it printed its own line), or when any trial of a sweep
failed, whichever launcher ran it (runs/sweep.py reads the trial dirs; one line names them).
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional

import hydra
from omegaconf import DictConfig

from kimik3.config.paths import CONF_DIR
from kimik3.config.store import register_configs
from kimik3.distributed import hydra_rank_overrides, read_dist_env
from kimik3.runs import run_dir as rundir
from kimik3.runs import sweep
from kimik3.runs.job import EXPECTED_ERRORS, full_error_wanted, run_task
from kimik3.runs.launch import plan_launch
from kimik3.runs.session import release_process_state, run, seed_everything

CONFIG_NAME = "train"


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
        if full_error_wanted():
            traceback.print_exc()
        _exit(str(e))

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
    def task(dcfg: DictConfig) -> Optional[float]:
        return run_task(dcfg, launch)

    sys.argv = [sys.argv[0], *launch.argv]
    sweep.take_finished_sweeps()  # only this command line's sweeps count
    task()
    for sweep_dir in sweep.take_finished_sweeps():
        failed, total = sweep.failed_trials(sweep_dir)
        if failed:
            _exit(sweep.failure_line(sweep_dir, failed, total))
    if launch.failures:
        sys.exit(1)  # the job already printed its line


def _exit(line: str) -> None:
    print(f"kimik3-train: error: {line}", file=sys.stderr, flush=True)
    sys.exit(1)


__all__ = ["CONF_DIR", "CONFIG_NAME", "main", "release_process_state", "run", "seed_everything"]

if __name__ == "__main__":
    main()
