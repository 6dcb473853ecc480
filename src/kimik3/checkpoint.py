"""Checkpoints: collect every resumable part's state_dict, write atomically, load safely.

A checkpoint is one torch.save'd dict (format version FORMAT_VERSION):
  model, optimizer        state_dicts (the learning rate is not state: the schedule is a pure
                          function of TrainState.step, so it needs nothing of its own)
  train_state             TrainState counters (step, tokens, skipped, ...)
  loaders                 {"train": cursor, "val": cursor} (TokenDataLoader.state_dict)
  rng                     Python, NumPy, torch CPU and CUDA generator states
  recipe                  what must match to continue: model config, vocab, dataset identity,
                          batch geometry, optimizer (see `recipe_of` / `check_compatible`)
  run_id, config          the run it belongs to and its full resolved config, for the record

Runs with train.parallel=ddp|fsdp save a torch.distributed.checkpoint directory `step-<n>/` instead
(kimik3.distributed.dcp: sharded, loadable at any world size); resume finds both kinds.

Writes go to a temp file in the same directory, are fsync'd, then `os.replace`d onto the final
name, so a crash leaves either the previous file or the new one, never half of one. Loads use
`torch.load(weights_only=True)`: a checkpoint is data, never code; that is also why the NumPy RNG
state is stored as plain lists and tensors rather than as NumPy arrays.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kimik3.write_errors import writing

FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)(\.pt)?")
"""`step-<n>.pt` (one process) or `step-<n>/` (a DCP directory of a multi-process run, kimik3.distributed.dcp)."""
DCP_METADATA = ".metadata"
_TEMP_NAME = re.compile(r"\.step-\d+\.pt\.tmp-(\d+)")
"""save_checkpoint's temp file, `.step-<n>.pt.tmp-<pid of the writer>`."""

# Model fields that do not change the weights or their meaning: a run may resume with another KDA
# implementation (e.g. chunk on CPU -> triton on GPU) or chunk size (the same recurrence by other
# blocks; triton and fla need 64), another preset name or init source.
_MODEL_FIELDS_FREE_ON_RESUME = ("kda_implementation", "kda_chunk_size", "name", "init_from")


class CheckpointError(ValueError):
    """An unreadable, foreign or incompatible checkpoint; the message is one line."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:06d}.pt"


def is_sharded_checkpoint(path: Path) -> bool:
    """True for a DCP checkpoint directory (written by runs with world_size > 1)."""
    return (Path(path) / DCP_METADATA).is_file()


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The highest-step `checkpoints/step-*.pt` file or `step-*` DCP directory of a run dir, or None."""
    found = [(int(m.group(1)), p) for p in (Path(run_dir) / CHECKPOINT_DIR).glob("step-*")
             if (m := _NAME.fullmatch(p.name)) and (m.group(2) or is_sharded_checkpoint(p))]
    return max(found)[1] if found else None


def remove_killed_writes(run_dir: Path) -> list[Path]:
    """Remove the temp files of checkpoint writes whose process died mid-save (SIGKILL, an OOM kill, a
    node lost): a whole checkpoint's bytes each, which nothing reads (resume never picks a hidden
    file) and nothing else would remove, since the next write of that step uses another pid. A file
    whose writer still lives on this host is left alone. Returns what was removed."""
    removed = []
    for path in sorted((Path(run_dir) / CHECKPOINT_DIR).glob(".step-*.pt.tmp-*")):
        found = _TEMP_NAME.fullmatch(path.name)
        if found and not _alive(int(found.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def resolve_resume(path: str) -> Path:
    """`train.resume` value -> checkpoint file: a file as given, a run dir -> its latest checkpoint."""
    p = Path(path).expanduser()
    if is_sharded_checkpoint(p):
        return p
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"train.resume={path}: the directory holds no {CHECKPOINT_DIR}/step-*.pt")
        return latest
    if not p.is_file():
        raise CheckpointError(f"train.resume={path}: no such checkpoint file or run dir")
    return p


def recipe_of(model_cfg: dict, vocab_size: int, dataset: dict, train_cfg: dict, world_size: int) -> dict:
    """The fields a continuation must share with its checkpoint (plain dicts, JSON-able)."""
    return {
        "model": {k: v for k, v in model_cfg.items() if k not in _MODEL_FIELDS_FREE_ON_RESUME},
        "vocab_size": vocab_size,
        "dataset": dataset,
        "train": {k: train_cfg[k] for k in ("batch_size", "seq_len", "grad_accum_steps", "optimizer")},
        "world_size": world_size,
    }


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    """Refuse to continue from a checkpoint whose recipe differs; names the first differing field.

    Batching is compared as the global batch (world_size * batch_size * grad_accum_steps
    sequences): any split of the same global batch reads the same tokens per step, so a run may
    resume at another world size (kimik3.distributed.dcp)."""
    compared = _global_batch(saved), _global_batch(current)
    for section in ("vocab_size", "dataset", "model", "train"):
        a, b = compared[0].get(section), compared[1][section]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and section in ("model", "train"):
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            if key == "global_batch":
                raise CheckpointError(
                    f"cannot resume from {path}: train.global_batch is {a[key]} in the checkpoint but {b[key]} now "
                    f"(world_size x train.batch_size x train.grad_accum_steps sequences: {_global_batch_parts(saved)} "
                    f"in the checkpoint, {_global_batch_parts(current)} now); any split of the same global batch can resume"
                )
            raise CheckpointError(
                f"cannot resume from {path}: {section}.{key} is {a.get(key)!r} in the checkpoint but {b.get(key)!r} now"
            )
        what = "dataset identity" if section == "dataset" else section
        raise CheckpointError(f"cannot resume from {path}: {what} differs (checkpoint {_brief(a)}, now {_brief(b)})")


def _global_batch(recipe: dict) -> dict:
    train = dict(recipe["train"])
    world = recipe.get("world_size", 1)
    train["global_batch"] = world * train.pop("batch_size") * train.pop("grad_accum_steps")
    return {**recipe, "train": train}


def _global_batch_parts(recipe: dict) -> str:
    """"<world> x <batch> x <accum>" of a recipe (world_size 1 where an old recipe has none)."""
    return f"{recipe.get('world_size', 1)} x {recipe['train']['batch_size']} x {recipe['train']['grad_accum_steps']}"


def save_checkpoint(path: Path, payload: dict) -> Path:
    """Write `payload` to `path` atomically (temp file + fsync + os.replace) and return the path.

    A write that fails (a full disk) leaves the earlier checkpoints as they were and raises
    kimik3.write_errors.WriteError naming `path`, where torch.save would raise a RuntimeError that
    does not say why."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                torch.save({"format": FORMAT_VERSION, **payload}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    return path


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint on CPU with weights_only=True; CheckpointError if unreadable or of another format."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's first line here advises retrying with weights_only=False, which is wrong advice for
        # a file kimik3 reads: its checkpoints always load weights-only, so this is some other file.
        raise CheckpointError(f"cannot read checkpoint {path}: not a kimik3 checkpoint (torch.load with "
                              f"weights_only=True cannot unpickle it)") from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{path} is not a kimik3 checkpoint of format {FORMAT_VERSION} (found format {found!r})"
        )
    return payload


def capture_rng() -> dict:
    """Every generator a training step may draw from, in weights_only-loadable types."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    """random.setstate wants nested tuples; serialisation may hand back lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _brief(value: object) -> str:
    if isinstance(value, dict) and "name" in value:
        return f"{value['name']!r}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
