"""Streamed safetensors reading and sharded writing, in the layout transformers uses.

Reading goes shard by shard through `model.safetensors.index.json` (or the single
`model.safetensors`) and yields one tensor at a time, so a caller that consumes each tensor before
asking for the next never holds the model twice. Writing buffers tensors up to `max_shard_bytes`,
flushes a shard, and at the end names the shards `model-0000i-of-0000n.safetensors` with an index
(one shard: plain `model.safetensors`, no index), inside a temporary dir renamed into place, so a
crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kimik3.hf.config_map import read_json
from kimik3.write_errors import writing

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # what transformers' save_pretrained uses


def shard_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint dir, in index order (or the single file)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = read_json(index)["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {missing}")
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"{model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """safe_open, with a truncated or corrupt shard reported as a ValueError naming the file: the
    callers' one-line errors catch ValueError, and SafetensorError's own message names no file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"cannot read {path}: {err}") from err


def tensor_names(model_dir: str | Path) -> list[str]:
    """All tensor names of a checkpoint dir, without reading any tensor data."""
    names: list[str] = []
    for path in shard_files(model_dir):
        with _open_shard(path) as f:
            names.extend(f.keys())
    return names


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor, one shard open at a time, one tensor materialised at a time."""
    for path in shard_files(model_dir):
        with _open_shard(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _default_file_mode() -> int:
    """0o666 under this process's umask: the mode open() gives a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class ShardedWriter:
    """Write named tensors into safetensors shards of at most `max_shard_bytes` (one tensor may exceed it).

    Use as a context manager; `extra_files` (name -> text) are written beside the weights, and the
    whole dir appears at `out_dir` only on a clean exit. `out_dir` must not exist or be empty.
    """

    def __init__(self, out_dir: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 metadata: Optional[dict[str, str]] = None) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise FileExistsError(f"{self.out_dir} exists and is not an empty dir; pick a new output path")
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.extra_files: dict[str, str] = {}
        self._tmp = self.out_dir.parent / f".{self.out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # names per flushed shard
        self._total_bytes = 0

    def __enter__(self) -> "ShardedWriter":
        self._tmp.mkdir(parents=True)
        return self

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first if this one would overflow it."""
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        shard = self._tmp / f"shard-{len(self._shards):05d}"
        with writing(self.out_dir):  # safetensors' error on a full disk is a SafetensorError quoting the errno
            save_file(self._pending, str(shard), metadata=self.metadata)
        shard.chmod(_default_file_mode())  # safetensors creates 0600; exports are for others to read
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _finish(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self._tmp / "shard-00000", self._tmp / SINGLE_FILE)
        else:
            weight_map = {}
            for i, names in enumerate(self._shards):
                final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(self._tmp / f"shard-{i:05d}", self._tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            (self._tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for fname, text in self.extra_files.items():
            (self._tmp / fname).write_text(text)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked in __init__); rename needs the name free
        os.replace(self._tmp, self.out_dir)

    def __exit__(self, exc_type, exc, tb) -> None:
        """Publish the dir on a clean exit; otherwise, or when publishing fails (the last shard is
        written here, where a full disk usually shows), remove the temp dir and every shard in it."""
        try:
            if exc_type is None:
                with writing(self.out_dir):
                    self._finish()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)  # gone already after a clean rename
