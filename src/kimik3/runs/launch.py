"""Command-line planning before Hydra starts: reproduce, resume in place, early config errors.

`plan_launch(argv)` rewrites the command line so the ordinary Hydra app does the rest:

- **Reproduce** (`--config-path <run>/.hydra --config-name config`): Hydra's saved config.yaml has no
  defaults list (hydra #2720), so composing from it would lose the dataclass schema and the hydra
  settings. Instead the app composes from the repo's conf/ with the schema, the saved config name
  and the saved `overrides.yaml` (your extra overrides appended, yours winning per key), and the task
  then compares the resolved recipe with the run's `config_resolved.yaml`, refusing any difference.
  A reproduce always makes a new run: a recipe that started from a checkpoint (`train.resume` in the
  saved overrides) starts from it again in the new run dir, never continuing the run it came from.
- **Resume in place** (`train.resume=<run dir or its checkpoint>`): the run's saved overrides are
  prepended (yours win), `hydra.run.dir` is set to that run dir unless you gave one, and this
  session's Hydra files go to `.hydra/session-<k>/` so the first session's record stays intact. In
  a sweep (`-m`) the saved overrides are prepended too and every trial is a new run in the sweep dir
  that starts from the checkpoint.
- **Early errors**: a single run's config is composed and validated here, before Hydra creates a run
  dir, so a typo or an invalid value costs one line on stderr and leaves no directory behind. A
  sweep (`-m`) is composed at every value of each swept key (sweep_points): a typo, a wrong type or
  an unknown option stops it the same way before its first trial, while the value checks
  (config/validate.py) stay with each trial, so one bad value costs its trial, not the sweep. An
  explicit hydra.run.dir / hydra.sweep.dir that already holds a run is refused here too.
- `--cfg` only prints the composed config: the command line is rewritten as above (so it shows what
  a reproduce or resume would run) but nothing is checked or refused.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser  # Hydra's own CLI grammar (hydra-core is pinned < 1.4)
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kimik3.checkpoint import CHECKPOINT_DIR, latest_checkpoint
from kimik3.config.validate import check_known_keys, validate
from kimik3.runs.run_dir import MANIFEST, RunDirError, load_saved_yaml, read_manifest, saved_overrides

REPRODUCE_FILES = ("hydra.yaml", "overrides.yaml")
"""What a reproduce reads from a run's .hydra/ (Hydra writes these into output dirs only; its composed
config.yaml is not used, see the module docstring, so a run that lost it still reproduces)."""


@dataclass
class Launch:
    """What main() hands to Hydra, and what the task function needs to know about this launch."""

    argv: list[str]
    reproduce_from: Optional[Path] = None
    """The run dir whose recipe is being reproduced."""
    resume_dir: Optional[Path] = None
    """The run dir being resumed in place."""
    multirun: bool = False
    failures: list[str] = field(default_factory=list)
    """One line per failed job of this process (main() exits non-zero when any)."""
    cwd_entries: frozenset[str] = frozenset()
    """Names in the working directory before Hydra ran: a run dir's parents created by this launch
    (`outputs/` on a first run) are removed with it when its job fails before it starts."""


def plan_launch(argv: list[str], conf_dir: Path, config_name: str) -> Launch:
    """Rewrite `argv` (without the program name) for reproduce / resume and pre-check it."""
    try:
        return _plan(argv, conf_dir, config_name)
    except (HydraException, OmegaConfBaseException) as e:
        raise RunDirError(one_line(e)) from e  # HYDRA_FULL_ERROR=1 shows the chain


def _plan(argv: list[str], conf_dir: Path, config_name: str) -> Launch:
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.experimental_rerun:
        return Launch(argv=list(argv))
    overrides = list(args.overrides)
    reproduce_from = None
    if args.config_path is not None and _is_hydra_dir(Path(args.config_path)):
        hydra_dir = Path(args.config_path).resolve()
        reproduce_from = _reproduced_run(hydra_dir)
        saved = load_saved_yaml(hydra_dir / "hydra.yaml")
        config_name = saved.hydra.job.config_name
        overrides = merge_overrides(saved_overrides(hydra_dir / "overrides.yaml"), overrides)
    elif args.config_path is not None or args.config_name is not None:
        config_name = args.config_name or config_name
        conf_dir = Path(args.config_path or conf_dir).resolve()
    # a reproduce starts from its recipe's checkpoint in a new run (its saved overrides are complete)
    resume_dir = _resume_run_dir(overrides) if not reproduce_from else None
    if resume_dir is not None and args.multirun:  # each trial: a new run from the checkpoint, in the sweep dir
        overrides, resume_dir = with_source_overrides(resume_dir, overrides), None
    elif resume_dir is not None:
        overrides, in_place = _resume_overrides(resume_dir, overrides)
        if in_place:
            _refuse_branching(resume_dir, overrides)
        resume_dir = resume_dir if in_place else None  # elsewhere: a new run that starts from the checkpoint
    flags = (["--multirun"] if args.multirun else []) + (["--config-dir", args.config_dir] if args.config_dir else [])
    if args.cfg is not None:
        flags += ["--cfg", args.cfg, *(["--package", args.package] if args.package else []),
                  *(["--resolve"] if args.resolve else [])]
    else:
        _refuse_existing_dirs(overrides, resume_dir)
        if args.multirun:
            _refuse_a_sweep_without_trials(overrides)
        compose_and_validate(conf_dir, config_name, sweep_points(overrides) if args.multirun else [overrides],
                             values=not args.multirun)
        _refuse_an_unwritable_output_dir(overrides, conf_dir / f"{config_name}.yaml", args.multirun)
    argv = [*flags, "--config-path", str(conf_dir), "--config-name", config_name, *overrides]
    return Launch(argv=argv, reproduce_from=reproduce_from, resume_dir=resume_dir, multirun=args.multirun,
                  cwd_entries=frozenset(os.listdir()))


def _reproduced_run(hydra_dir: Path) -> Path:
    """The run dir whose first-session Hydra dir `hydra_dir` is; a resumed session's
    `.hydra/session-<k>/` is refused (its recipe continued the run from a checkpoint)."""
    if hydra_dir.parent.name == ".hydra" and hydra_dir.name.startswith("session-"):
        run = hydra_dir.parent.parent
        raise RunDirError(
            f"{hydra_dir} records {hydra_dir.name} of {run}, a resume of that run; reproduce takes a run's "
            f"first session: --config-path {run}/.hydra (to redo a later session, start from one of its "
            f"checkpoints in a new run: train.resume={run}/{CHECKPOINT_DIR}/<step> hydra.run.dir=<new dir>)")
    return hydra_dir.parent


MAX_SWEEP_POINTS = 32
"""The most compositions a sweep's pre-check makes (each ~10-50 ms)."""


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Concrete command lines that between them give each swept key every value once, the other keys
    at their first value (so each is a point of a grid sweep): composing them catches a typo, a wrong
    type or an unknown option anywhere in a sweep before its first trial, in as many compositions as
    values rather than the grid's product. An interval (Optuna) is composed at its lower end, which
    the sampler may draw; a glob over a group's options is left to Hydra. At most MAX_SWEEP_POINTS
    lines (a larger sweep's later values are checked by their own trials)."""
    parser = OverridesParser.create()
    choices: list[list[str]] = []
    for text, o in zip(overrides, parser.parse_overrides(overrides)):
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices.append([text])
        elif o.is_interval_sweep():
            choices.append([f"{key}={o.value().start}"])
        elif o.is_discrete_sweep() and o.value_type != ValueType.GLOB_CHOICE_SWEEP:
            choices.append([f"{key}={value}" for value in o.sweep_string_iterator()])
        else:
            choices.append([])
    points = [[c[0] for c in choices if c]]
    for i, options in enumerate(choices):
        for value in options[1:]:
            points.append([value if j == i else c[0] for j, c in enumerate(choices) if c])
    return points[:MAX_SWEEP_POINTS]


def compose_and_validate(conf_dir: Path, config_name: str, command_lines: list[list[str]], *,
                         values: bool = True) -> None:
    """Compose each command line's overrides like the app will, check it against the schema and, with
    `values`, run config/validate.py on it (Hydra errors propagate)."""
    from kimik3.config.schema import RootConfig

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3", job_name="train"):
        for overrides in command_lines:
            cfg = compose(config_name, overrides=overrides)
            check_known_keys(cfg)
            root = OmegaConf.to_object(cfg)
            assert isinstance(root, RootConfig), f"{config_name} composed to {type(root).__name__}, not RootConfig"
            if values:
                validate(root)


def one_line(e: BaseException) -> str:
    """Hydra / OmegaConf errors span lines (and a cause); keep what names the problem, on one line."""
    lines: list[str] = []
    for part in (e, e.__cause__):
        for line in str(part or "").splitlines():
            line = line.strip()
            if line.startswith(("Config search path", "See https", "Set the environment variable")):
                break
            # Hydra's "To append to your config use +key=..." hint is dropped: kimik3 refuses keys
            # the schema does not have, so following it would only trade one error for another.
            if line and not line.startswith(("full_key:", "reference_type=", "object_type=", "provider=",
                                             "To append to your config")):
                lines.append(line)
    return " ".join(lines) or type(e).__name__


def merge_overrides(base: list[str], extra: list[str]) -> list[str]:
    """`base` then `extra`, dropping the base entries whose key `extra` sets again."""
    parser = OverridesParser.create()
    extra_keys = {o.key_or_group for o in parser.parse_overrides(extra)}
    kept = [text for text, o in zip(base, parser.parse_overrides(base)) if o.key_or_group not in extra_keys]
    return kept + list(extra)


def _is_hydra_dir(path: Path) -> bool:
    """True for a run's Hydra dir (a reproduce); a config dir of your own holds neither REPRODUCE_FILES
    file, and one that holds only one of them is a damaged run's, refused by name."""
    present = [name for name in REPRODUCE_FILES if (path / name).is_file()]
    if present and len(present) < len(REPRODUCE_FILES):
        missing = ", ".join(name for name in REPRODUCE_FILES if name not in present)
        raise RunDirError(f"--config-path {path} is a run's Hydra dir without {missing}, which a reproduce reads "
                          f"(with {', '.join(present)}); restore it from a copy of the run")
    return bool(present)


def _override_value(overrides: list[str], key: str) -> Optional[str]:
    """The last plain `key=value` among `overrides` (None when absent or null)."""
    value = None
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.key_or_group == key:
            value = o.value()
    return None if value is None else str(value)


def _resume_run_dir(overrides: list[str]) -> Optional[Path]:
    """The run dir that train.resume points into (a run dir or a file in its checkpoints/), if any."""
    target = _override_value(overrides, "train.resume")
    if target is None:
        return None
    path = Path(target).expanduser().resolve()
    for candidate in (path, path.parent.parent if path.parent.name == CHECKPOINT_DIR else None):
        if candidate is not None and (candidate / MANIFEST).is_file():
            return candidate
    return None


def with_source_overrides(run_dir: Path, overrides: list[str]) -> list[str]:
    """The run's own recipe (its first session's overrides, less the checkpoint it may have started
    from) under yours: what a run started from one of its checkpoints trains, whether it continues
    the run, branches into a new dir or is one trial of a sweep (-m train.resume=<run> ...)."""
    saved = saved_overrides(run_dir / ".hydra" / "overrides.yaml") if (run_dir / ".hydra").is_dir() else []
    return merge_overrides([s for s in saved if not s.lstrip("+~").startswith("train.resume=")], overrides)


def _resume_overrides(run_dir: Path, overrides: list[str]) -> tuple[list[str], bool]:
    """with_source_overrides, and whether the session runs in place: then the run dir is set (unless you
    gave it) and this session's Hydra files go to `.hydra/session-<k>/`, so the first session's record
    is never overwritten."""
    merged = with_source_overrides(run_dir, overrides)
    explicit = _override_value(merged, "hydra.run.dir")
    in_place = explicit is None or Path(explicit).expanduser().resolve() == run_dir
    if explicit is None:
        merged.append(f"hydra.run.dir='{run_dir}'")
    if in_place and _override_value(merged, "hydra.output_subdir") is None:
        merged.append(f"hydra.output_subdir=.hydra/session-{len(read_manifest(run_dir)['sessions']) + 1}")
    return merged, in_place


def _refuse_branching(run_dir: Path, overrides: list[str]) -> None:
    """Continuing a run in place from a checkpoint older than its newest would leave the newer ones
    beside the new branch's, and a later train.resume=<run> would pick them up: refused."""
    target = Path(str(_override_value(overrides, "train.resume"))).expanduser().resolve()
    newest = latest_checkpoint(run_dir)
    if newest is not None and target != run_dir and target != newest.resolve():
        raise RunDirError(
            f"train.resume={target} is not the newest checkpoint of {run_dir} ({newest.name} is): continuing "
            f"the run from it would leave {newest.name} beside the new steps; start a new run from it "
            f"(add hydra.run.dir=<new dir>) or resume the run itself (train.resume={run_dir})")


def _refuse_a_sweep_without_trials(overrides: list[str]) -> None:
    """`hydra.sweeper.n_trials` below 1 runs no trial, and the Optuna plugin then asks its empty study
    for the best trial: a traceback after the sweep dir was made, where one line says it up front."""
    n_trials = _override_value(overrides, "hydra.sweeper.n_trials")
    if n_trials is not None and n_trials.lstrip("-").isdigit() and int(n_trials) < 1:
        raise RunDirError(f"hydra.sweeper.n_trials={n_trials} runs no trial: give 1 or more")


def _refuse_an_unwritable_output_dir(overrides: list[str], primary: Path, multirun: bool) -> None:
    """Hydra makes the run (sweep) dir before kimik3 runs, and on a read-only mount or a dir you may not
    write its mkdir failed with a traceback. The fixed part of the dir's name (before any `${...}`) is
    probed here at its nearest existing dir with a nameless temp file, which is what the run would do
    there (root may write where the mode bits say no, and then the run would work too)."""
    section = "sweep" if multirun else "run"
    key = f"hydra.{section}.dir"
    value = _override_value(overrides, key)
    if value is None and primary.is_file():  # the primary config's pattern, unresolved: outputs/${kimik3.run_id:}
        value = OmegaConf.to_container(OmegaConf.load(primary), resolve=False).get("hydra", {}).get(section, {}).get("dir")
    if not isinstance(value, str):
        return
    probe = Path(value.split("${", 1)[0] or ".").expanduser()
    while not probe.is_dir() and probe != probe.parent:
        probe = probe.parent
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise RunDirError(f"{key}={value}: cannot write in {probe.resolve()} ({e.strerror}); pick a writable {key}") from None


def _refuse_existing_dirs(overrides: list[str], resume_dir: Optional[Path]) -> None:
    run_dir = _override_value(overrides, "hydra.run.dir")
    if run_dir is not None and (Path(run_dir) / MANIFEST).is_file():
        if resume_dir is None or Path(run_dir).resolve() != resume_dir:
            raise RunDirError(
                f"hydra.run.dir={run_dir} already holds a run ({MANIFEST}); continue it with "
                f"train.resume={run_dir} or pick a new hydra.run.dir"
            )
    sweep_dir = _override_value(overrides, "hydra.sweep.dir")
    if sweep_dir is not None and any(Path(sweep_dir).glob(f"*/{MANIFEST}")):
        raise RunDirError(f"hydra.sweep.dir={sweep_dir} already holds runs; pick a new hydra.sweep.dir")


__all__ = ["Launch", "compose_and_validate", "merge_overrides", "one_line", "plan_launch", "sweep_points"]
