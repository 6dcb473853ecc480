"""kimik3-runs: a table of the runs under a directory (default `outputs/` and `multirun/`).

A run is any directory holding `run.json` or `metrics.jsonl` (the run dir contract); runs are
found recursively, so a date-nested `outputs/` tree, a single run dir and a sweep dir all work.
A run is a sweep trial when its `.hydra/hydra.yaml` says `mode: MULTIRUN` (or its parent holds
Hydra's `multirun.yaml`, which the basic sweeper writes and the Optuna sweeper does not); its
parent dir is the sweep dir. Trials are ranked by objective and the best one is marked with `*`.

Status rule (from metrics.jsonl alone, so it works on a copy of the run dir):
  - the last event is "end": its "status" field (finished, failed, interrupted or end_of_data);
  - otherwise "running" if metrics.jsonl (or run.json, when no event was written yet) was
    modified within --stale-after seconds (default 600), else "crashed" (the process died
    without writing "end": killed, OOM, power loss).
A run resumed after an "end" appends "start"/"resume" events, so it reads as running again.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from kimik3.runs.metrics import read_events

RUN_FILES = ("run.json", "metrics.jsonl")
DEFAULT_ROOTS = ("outputs", "multirun")
"""Where conf/train.yaml puts single runs (hydra.run.dir) and sweeps (hydra.sweep.dir)."""
CONFIG_FILES = ("config_resolved.yaml", ".hydra/config.yaml")
ERROR_FILE = "error.txt"
OPTUNA_FILE = "optimization_results.yaml"
STALE_AFTER_S = 600.0
SORT_KEYS = ("run", "run_id", "model", "status", "steps", "tokens", "train_loss", "val_loss",
             "objective", "created")


@dataclass
class RunRecord:
    """One row of the table: what a run dir says about itself."""

    path: Path
    name: str
    """Path relative to the listed directory: what `kimik3-plot` and `train.resume` take."""
    run_id: Optional[str]
    model: Optional[str]
    overrides: list[str]
    steps: int
    tokens: int
    train_loss: Optional[float]
    val_loss: Optional[float]
    objective: Optional[float]
    status: str
    created: Optional[str]
    error: Optional[str] = None
    """Why the run's last session failed or was interrupted: error.txt's newest line, else the "end"
    event's "error" field; None for a run whose last session finished, runs or crashed."""
    sweep: Optional[Path] = None
    """The sweep dir this run is a trial of (its parent), None for a single run."""
    best: bool = False
    """Lowest finite objective among the trials of its sweep."""
    last_write: float = field(default=0.0, repr=False)


def read_overrides(run_dir: Path) -> list[str]:
    """Hydra task overrides of a run: run.json's list, else `.hydra/overrides.yaml`."""
    manifest = _read_manifest(run_dir)
    if "overrides" in manifest:
        return [str(o) for o in manifest["overrides"]]
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in _load_yaml(path) or []] if path.is_file() else []


def config_value(run_dir: Path, key: str):
    """The value at a dotted key of the run's recipe, or None.

    `config_resolved.yaml` (written by the trainer) holds every field with defaults filled in;
    `.hydra/config.yaml` is the fallback for a run that died before writing it.
    """
    for name in CONFIG_FILES:
        path = Path(run_dir) / name
        if path.is_file():
            return _select(_load_yaml(path), key)
    return None


def as_number(value) -> Optional[float]:
    """A metric value as float; None for missing, text or bool values."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def is_sweep_trial(run_dir: Path) -> bool:
    """Whether Hydra ran this job as part of a multirun (the rule in the module docstring)."""
    if (run_dir.parent / "multirun.yaml").is_file():
        return True
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    return hydra_file.is_file() and _select(_load_yaml(hydra_file), "hydra.mode") == "MULTIRUN"


def find_runs(root: Path) -> list[Path]:
    """Every run dir at or below `root`, sorted by path with numbers in numeric order (trial 2
    before trial 10)."""
    root = Path(root)
    found = {p.parent for name in RUN_FILES for p in root.rglob(name)}
    return sorted(found, key=lambda path: [(0, int(part), "") if part.isdigit() else (1, 0, part)
                                           for part in path.parts])


def run_status(events: list[dict], last_write: float, now: float, stale_after: float) -> str:
    """finished / failed / interrupted / end_of_data / running / crashed: the rule in the module docstring."""
    if events and events[-1]["event"] == "end":
        return str(events[-1].get("status", "finished"))
    return "running" if now - last_write < stale_after else "crashed"


def load_run(run_dir: Path, root: Path, *, now: float, stale_after: float = STALE_AFTER_S
             ) -> RunRecord:
    """Summarise one run dir; `root` only sets the display name."""
    run_dir = Path(run_dir)
    manifest = _read_manifest(run_dir)
    events = read_events(run_dir)
    end = events[-1] if events and events[-1]["event"] == "end" else {}
    last_write = max((p.stat().st_mtime for p in map(run_dir.joinpath, RUN_FILES) if p.is_file()),
                     default=0.0)
    name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    status = run_status(events, last_write, now, stale_after)
    return RunRecord(
        path=run_dir,
        name=name,
        run_id=manifest.get("run_id"),
        model=(manifest.get("model") or {}).get("name") or config_value(run_dir, "model.name"),
        overrides=read_overrides(run_dir),
        steps=int(events[-1].get("step", 0)) if events else 0,
        tokens=int(events[-1].get("tokens", 0)) if events else 0,
        train_loss=as_number(end.get("train_loss", _last(events, "train", "loss"))),
        val_loss=as_number(end.get("val_loss", _last(events, "eval", "val_loss"))),
        objective=as_number(end.get("objective")),
        status=status,
        created=manifest.get("created"),
        error=(_error_line(run_dir) or end.get("error")) if status in ("failed", "interrupted") else None,
        sweep=run_dir.parent if is_sweep_trial(run_dir) else None,
        last_write=last_write,
    )


def optuna_summary(path: Path) -> str:
    """One line from the Optuna sweeper's result file, to check against the starred trial."""
    results = _load_yaml(path)
    if "best_params" not in results:  # multi-objective sweeps list best_trials instead
        return f"{path.name}: {len(results.get('best_trials', []))} Pareto-optimal trials"
    params = " ".join(f"{k}={v}" for k, v in results["best_params"].items())
    return f"{path.name}: best_value={results['best_value']} at {params}"


def load_runs(root: Path, *, base: Optional[Path] = None, stale_after: float = STALE_AFTER_S
              ) -> list[RunRecord]:
    """Every run under `root` (named relative to `base`, default `root`), with the best trial of
    each sweep marked."""
    root = Path(root)
    now = time.time()
    records = [load_run(d, base or root, now=now, stale_after=stale_after) for d in find_runs(root)]
    by_sweep: dict[Path, list[RunRecord]] = {}
    for record in records:
        if record.sweep is not None and _finite(record.objective):
            by_sweep.setdefault(record.sweep, []).append(record)
    for trials in by_sweep.values():
        min(trials, key=lambda r: r.objective).best = True
    return records


def sort_records(records: list[RunRecord], key: str) -> list[RunRecord]:
    """Sort by a column; a leading '-' sorts descending. Missing values go last either way."""
    descending = key.startswith("-")
    column = key.lstrip("-")
    if column not in SORT_KEYS:
        raise ValueError(f"--sort {key!r} is not a column; accepted: {', '.join(SORT_KEYS)} "
                         "(prefix '-' for descending)")
    present = [r for r in records if getattr(r, column) is not None]
    missing = [r for r in records if getattr(r, column) is None]
    return sorted(present, key=lambda r: getattr(r, column), reverse=descending) + missing


def matches(record: RunRecord, query: str) -> bool:
    """Whether a run passes one --filter query.

    `key=value` compares a column (status=running), else the run's setting of a config key: its
    override (model=smoke) or, when not overridden, its recipe value (train.lr=0.003 matches a run
    on the default lr); numbers compare as numbers. Anything else is a substring of the name, id,
    model or overrides.
    """
    if "=" not in query:
        haystack = " ".join([record.name, record.run_id or "", record.model or "", *record.overrides])
        return query in haystack
    key, value = query.split("=", 1)
    actual = getattr(record, key) if key in SORT_KEYS else setting(record.path, record.overrides, key)
    return _same_value(actual, value)


def override_dict(overrides: list[str]) -> dict[str, str]:
    """Hydra override strings as key -> value ('+key=v' and '~key' give 'key')."""
    return dict(o.lstrip("+~").partition("=")[::2] for o in overrides)


def setting(run_dir: Path, overrides: list[str], key: str):
    """What a run set `key` to: its override's value, else the recipe's scalar value, else None
    (a config group such as model= is only known from the override)."""
    given = override_dict(overrides)
    if key in given:
        return given[key]
    value = config_value(run_dir, key)
    return value if not isinstance(value, (dict, list)) and value is not None else None


def shared_overrides(override_lists: list[list[str]]) -> set[str]:
    """The overrides every one of several runs has (none for a single run: nothing to factor)."""
    if len(override_lists) < 2:
        return set()
    return set.intersection(*map(set, override_lists))


def format_table(records: list[RunRecord]) -> str:
    """A fixed-width text table.

    Overrides every listed run shares are printed once above it; the overrides column keeps the
    rest. The id column appears when some run id is not its dir name (or `<sweep>_<trial>`), the
    objective column when sweep trials are listed.
    """
    columns = ["run", "model", "status", "steps", "tokens", "train_loss", "val_loss"]
    if any(r.run_id not in (None, r.path.name, f"{r.path.parent.name}_{r.path.name}")
           for r in records):
        columns.insert(1, "id")
    if any(r.sweep is not None for r in records):
        columns.append("objective")
    columns.append("overrides")
    shared = shared_overrides([r.overrides for r in records])
    rows = [[_cell(r, c, shared) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = [f"overrides of every run: {' '.join(o for o in records[0].overrides if o in shared)}"
             ] if shared else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kimik3-runs", description="List kimik3 runs and sweeps (best trial marked with *).")
    parser.add_argument("dir", nargs="?", default=None,
                        help="directory to scan: outputs/, a sweep dir or a run dir "
                             f"(default: {' and '.join(DEFAULT_ROOTS)} under the current dir)")
    parser.add_argument("--sort", default=None,
                        help=f"column to sort by, '-' prefix for descending: {', '.join(SORT_KEYS)} "
                             "(default: objective for a sweep dir, else created)")
    parser.add_argument("--filter", action="append", default=[], metavar="QUERY",
                        help="key=value on a column or override (train.lr=1e-3), or a substring; "
                             "repeat to AND them")
    parser.add_argument("--stale-after", type=float, default=STALE_AFTER_S, metavar="SECONDS",
                        help="a run without an 'end' event is crashed once metrics.jsonl is this old")
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):  # `--sort -val_loss`: argparse would take -val_loss for an option
        if arg == "--sort" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--sort={argv[i + 1]}"]
            break
    args = parser.parse_args(argv)

    if args.dir is None:  # names then start with outputs/ or multirun/, as kimik3-plot takes them
        roots = [Path(d) for d in DEFAULT_ROOTS if Path(d).is_dir()]
        if not roots:
            parser.error(f"no {' or '.join(DEFAULT_ROOTS)} dir here: pass the directory to scan")
        records = [r for root in roots
                   for r in load_runs(root, base=Path("."), stale_after=args.stale_after)]
    else:
        roots = [Path(args.dir)]
        if not roots[0].is_dir():
            parser.error(f"{roots[0]} is not a directory")
        records = load_runs(roots[0], stale_after=args.stale_after)
    found = len(records)
    records = [r for r in records if all(matches(r, q) for q in args.filter)]
    sweep_dir = len(roots) == 1 and any(r.sweep == roots[0] for r in records)
    sort_key = args.sort or ("objective" if sweep_dir else "created")
    try:
        records = sort_records(records, sort_key)
    except ValueError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps([_jsonable(r) for r in records], indent=1))
    elif records:
        print(format_table(records))
        for record in (r for r in records if r.error):
            print(f"{record.name}: {record.error}")
        if sweep_dir and (roots[0] / OPTUNA_FILE).is_file():
            print(optuna_summary(roots[0] / OPTUNA_FILE))
    else:
        print(nothing_listed(roots, found, args.filter), file=sys.stderr)
    return 0


def nothing_listed(roots: list[Path], found: int, filters: list[str]) -> str:
    """Why the listing is empty: no run dirs at all, or runs that the filters all left out (named, with
    the count, so a mistyped filter is not taken for an empty directory)."""
    where = " or ".join(map(str, roots))
    if not found:
        return f"no runs under {where}"
    queries = " ".join(f"--filter {shlex.quote(q)}" for q in filters)
    return f"no run matches {queries} ({found} run{'s' if found != 1 else ''} under {where})"


def _load_yaml(path: Path):
    """Plain YAML, not OmegaConf: ~20x faster (a listing reads a few files per run), and the
    values are only read, never resolved (`${...}` stays text)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _select(node, key: str):
    """node[a][b][c] for key "a.b.c", or None where the path does not exist."""
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _read_manifest(run_dir: Path) -> dict:
    path = Path(run_dir) / "run.json"
    try:
        manifest = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # not JSON, or not UTF-8 (garbled bytes)
        return {}
    return manifest if isinstance(manifest, dict) else {}  # a damaged run.json: list what metrics.jsonl says


def _error_line(run_dir: Path) -> Optional[str]:
    """error.txt's newest line: each failed or interrupted session appends one, so after a resume
    the first line is an older session's reason."""
    path = run_dir / ERROR_FILE
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else None


def _last(events: list[dict], kind: str, key: str):
    return next((e.get(key) for e in reversed(events) if e["event"] == kind and key in e), None)


def _finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def _same_value(actual, wanted: str) -> bool:
    try:
        return float(actual) == float(wanted)
    except (TypeError, ValueError):
        return str(actual) == wanted


def _cell(record: RunRecord, column: str, shared: set[str]) -> str:
    if column == "run":
        return record.name + (" *" if record.best else "")
    if column == "id":
        return record.run_id or "-"
    if column == "overrides":
        return " ".join(o for o in record.overrides if o not in shared) or "-"
    if column == "tokens":
        return _human(record.tokens)
    value = getattr(record, column)
    if value is None:
        return "-"
    if not isinstance(value, float):
        return str(value)
    # A diverging run's loss reaches 1e30 and more: 4 decimals of it would take 40 columns.
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _jsonable(record: RunRecord) -> dict:
    out = asdict(record)
    out["path"] = str(record.path)
    out["sweep"] = str(record.sweep) if record.sweep else None
    del out["last_write"]
    return out


if __name__ == "__main__":
    sys.exit(main())
