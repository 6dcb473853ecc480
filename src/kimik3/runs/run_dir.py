"""The run directory (= Hydra's output dir): its name, its run.json manifest and its life cycle.

Layout of a run dir:
  .hydra/                 Hydra's config.yaml, hydra.yaml, overrides.yaml of the first session
  .hydra/session-<k>/     the same for the k-th session when a run is resumed in place
  config_resolved.yaml    the full resolved recipe; run.json's config_hash is the hash of it
  run.json                manifest: run id, model and dataset identity, sessions
  metrics.jsonl           events (kimik3.runs.metrics)
  checkpoints/step-*.pt   checkpoints (kimik3.checkpoint)
  profile/, tb/           profiler traces, TensorBoard events
  error.txt               one line, present when a session failed
  train.log               Hydra's job log

Names: `kimik3.run_id` (an OmegaConf resolver used by conf/train.yaml) gives `<date>_<time>_<6 hex>`,
so two runs started in the same second still get different dirs. Under torchrun every rank must
resolve the same name without talking to the others: see `new_run_id`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import kimik3
from kimik3.config.schema import RootConfig
from kimik3.write_errors import writing

RUN_ID_RESOLVER = "kimik3.run_id"
MANIFEST = "run.json"
RESOLVED_CONFIG = "config_resolved.yaml"
ERROR_FILE = "error.txt"
MANIFEST_FORMAT = 1
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]+")


class RunDirError(ValueError):
    """A run dir that cannot be used as asked; the message is one line."""


def register_resolvers() -> None:
    """Register `${kimik3.run_id:}` (cached per config, so a sweep's jobs share one sweep dir)."""
    if not OmegaConf.has_resolver(RUN_ID_RESOLVER):
        OmegaConf.register_new_resolver(RUN_ID_RESOLVER, lambda: new_run_id(os.environ), use_cache=True)


def new_run_id(env: Mapping[str, str]) -> str:
    """A run name that no other run started on this machine shares.

    - KIMIK3_RUN_ID, when set, is used as is (a launcher sets it once for all ranks and nodes).
    - Under torchrun on one node, the ranks are children of one elastic agent: the name is built from
      the agent's start time and pid, so every rank computes the same name by construction.
      Several nodes need KIMIK3_RUN_ID (or an explicit hydra.run.dir).
    - Otherwise: local time plus 6 random hex digits.
    """
    explicit = env.get("KIMIK3_RUN_ID")
    if explicit:
        if not _SAFE_ID.fullmatch(explicit):
            raise RunDirError(f"KIMIK3_RUN_ID={explicit!r} may only hold letters, digits, '.', '_' and '-'")
        return explicit
    if "TORCHELASTIC_RUN_ID" in env:
        return _torchrun_run_id(env)
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(3)}"


def _torchrun_run_id(env: Mapping[str, str]) -> str:
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise RunDirError("a multi-node torchrun needs KIMIK3_RUN_ID (the same on every node) or hydra.run.dir")
    agent = os.getppid()
    try:
        ticks = int(Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        raise RunDirError("cannot read the torchrun agent's start time from /proc; set KIMIK3_RUN_ID") from None
    started = boot + ticks / os.sysconf("SC_CLK_TCK")
    key = f"{env['TORCHELASTIC_RUN_ID']}:{socket.gethostname()}:{agent}:{ticks}"
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(started))}_{hashlib.sha1(key.encode()).hexdigest()[:6]}"


def config_dict(cfg: object) -> dict:
    """A config dataclass as a plain dict (what gets hashed, saved and compared)."""
    return dataclasses.asdict(cfg)


def config_hash(cfg: object) -> str:
    """sha256 of the resolved config's canonical JSON: equal hashes mean equal recipes."""
    return hashlib.sha256(json.dumps(config_dict(cfg), sort_keys=True).encode()).hexdigest()


def check_new_or_resuming(run_dir: Path, resuming_here: bool) -> bool:
    """True when `run_dir` already holds a run (which only a resume into it may continue)."""
    exists = (Path(run_dir) / MANIFEST).is_file()
    if exists and not resuming_here:
        raise RunDirError(
            f"{run_dir} already holds a run ({MANIFEST}); continue it with train.resume={run_dir} "
            "or pick a new hydra.run.dir"
        )
    return exists


def read_manifest(run_dir: Path) -> dict:
    """run.json, or one line (RunDirError) naming it when it is damaged (cut off, edited, not a run's
    manifest), where json's own error names neither the file nor a way on."""
    path = Path(run_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        problem = f"not readable JSON ({getattr(e, 'msg', e)})"
    else:
        if isinstance(manifest, dict) and isinstance(manifest.get("sessions"), list) and "run_id" in manifest:
            return manifest
        problem = "not a run manifest (a JSON object with run_id and sessions)"
    raise RunDirError(f"{path} is {problem}; restore it, or start a new run from one of the run's checkpoints "
                      f"(train.resume={Path(run_dir) / 'checkpoints'}/<step> hydra.run.dir=<new dir>)")


def start_session(run_dir: Path, *, run_id: str, cfg: object, overrides: list[str], model: dict,
                  dataset: dict, session: dict) -> dict:
    """Create run.json (new run) or append `session` to it (resume in place); returns the manifest.

    `session` holds the per-session facts (resumed_from, world_size, device, ...); the session id,
    start time, versions, git commit, config hash and overrides are added here.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    digest = config_hash(cfg)
    record = {"session_id": secrets.token_hex(4), "started": _now(), "git_commit": git_commit(),
              "kimik3_version": kimik3.__version__, **session, "config_hash": digest, "overrides": overrides}
    if (run_dir / MANIFEST).is_file():
        manifest = read_manifest(run_dir)
        if manifest["run_id"] != run_id:
            raise RunDirError(f"{run_dir}/{MANIFEST} belongs to run {manifest['run_id']!r}, not {run_id!r}")
        manifest["sessions"].append(record)
    else:
        manifest = {"format": MANIFEST_FORMAT, "run_id": run_id, "created": record["started"], "model": model,
                    "dataset": dataset, "config_hash": digest, "overrides": overrides, "sessions": [record]}
        with writing(run_dir / RESOLVED_CONFIG):
            OmegaConf.save(OmegaConf.structured(cfg), run_dir / RESOLVED_CONFIG)
    write_manifest(run_dir, manifest)
    return manifest


def end_session(run_dir: Path, status: str, steps: int) -> None:
    """Record the last session's end (status, step reached) in run.json."""
    manifest = read_manifest(run_dir)
    manifest["sessions"][-1].update(ended=_now(), status=status, step=steps)
    write_manifest(run_dir, manifest)


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """Atomic replace, so a reader never sees half a run.json (nor is a half-written temp file left
    beside it when the write fails)."""
    path = Path(run_dir) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    with writing(path):
        try:
            tmp.write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def mark_failed(run_dir: Path, message: str) -> None:
    """Leave the one-line reason of a failed session in `<run>/error.txt`."""
    with open(Path(run_dir) / ERROR_FILE, "a", encoding="utf-8") as f:
        f.write(f"{_now()} {message}\n")


def discard_unstarted(run_dir: Path, hydra_subdir: Optional[Path], log_file: Optional[Path]) -> None:
    """Remove what Hydra wrote for a session that failed before it started (no run.json of its own).

    Only Hydra's own files go (its output subdir and job log); the run dir itself is removed only if
    that leaves it empty, so a hydra.run.dir pointing at a directory with other files is never harmed.
    """
    import shutil

    if hydra_subdir is not None and hydra_subdir.is_dir():
        shutil.rmtree(hydra_subdir)
    if log_file is not None:
        log_file.unlink(missing_ok=True)
    for parent in (hydra_subdir.parent if hydra_subdir else None, Path(run_dir)):
        if parent is not None and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def prune_new_parents(run_dir: Path, cwd: Path, cwd_entries: frozenset[str]) -> None:
    """Remove the empty parents of a discarded run dir inside `cwd` whose top folder was not among
    `cwd_entries` (the names there before the launch): `outputs/` made by a first run that failed."""
    run_dir, cwd = Path(run_dir).resolve(), Path(cwd).resolve()
    if cwd not in run_dir.parents or run_dir.relative_to(cwd).parts[0] in cwd_entries:
        return
    for parent in run_dir.parents:
        if parent == cwd or not parent.is_dir() or any(parent.iterdir()):
            return
        parent.rmdir()


def saved_recipe(run: Path) -> dict:
    """The resolved recipe of a run: its config_resolved.yaml, else Hydra's saved config.yaml
    merged onto the schema (which also rejects keys the schema no longer has)."""
    resolved = Path(run) / RESOLVED_CONFIG
    source = resolved if resolved.is_file() else Path(run) / ".hydra" / "config.yaml"
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), load_saved_yaml(source))
        return config_dict(OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise RunDirError(f"{source} does not fit the config schema ({str(e).strip().splitlines()[0]}); "
                          f"restore it from a copy of the run") from None


def load_saved_yaml(path: Path) -> DictConfig | ListConfig:
    """A YAML file saved in a run dir (.hydra/*.yaml, config_resolved.yaml), or one line (RunDirError)
    naming it when it is damaged: yaml's own error spans four lines and reaches the user as a traceback."""
    try:
        return OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        raise RunDirError(f"{path} is not readable YAML ({problem}{where}); restore it from a copy of the run") from None


def saved_overrides(path: Path) -> list[str]:
    """A run's .hydra/overrides.yaml: Hydra's list of `key=value` strings, else one line naming the file."""
    overrides = load_saved_yaml(path)
    if not isinstance(overrides, ListConfig) or not all(isinstance(o, str) for o in overrides):
        raise RunDirError(f"{path} is not a list of overrides (one `key=value` string per item, as Hydra writes "
                          f"it); restore it from a copy of the run")
    return list(overrides)


def compare_recipes(saved: dict, current: dict, where: str) -> None:
    """Refuse a reproduce whose resolved recipe differs from the saved one, naming the fields."""
    diffs = sorted(diff_dicts(saved, current))
    if diffs:
        shown = ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in diffs[:3])
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise RunDirError(f"reproduce from {where}: the recipe differs at {shown}{more}")


def diff_dicts(a: object, b: object, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for every leaf where two nested dicts differ (None = absent)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in set(a) | set(b) for d in diff_dicts(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def git_commit() -> Optional[str]:
    """HEAD of the source checkout kimik3 runs from, with '-dirty' for uncommitted changes; None if not git."""
    src = Path(kimik3.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(src), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
