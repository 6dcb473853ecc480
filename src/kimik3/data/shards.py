"""Token shards on disk: the writer, meta.json, and ShardedTokenDataset (the reader).

A prepared dir holds `meta.json`, `train_000000.bin ...`, `val_000000.bin ...` (and `tokenizer.json`
for BPE). A shard is a raw little-endian array of token ids (uint16 when the vocab fits in 65536
ids, else uint32) that `np.memmap` maps without parsing. meta.json records the format version,
tokenizer identity, vocab size, dtype, token counts, and each shard's size and sha256. Opening a
split checks that every shard exists with exactly the recorded size (cheap); `verify()` also
re-hashes the bytes (reads everything).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kimik3.data.errors import DataError

FORMAT_VERSION = 1
"""Version of the prepared-dir layout; readers refuse any other."""
META_FILE = "meta.json"
SPLITS = ("train", "val")
_META_FIELDS = ("name", "tokenizer", "source", "vocab_size", "eot_id", "dtype", "splits")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""meta.json dtype name -> the little-endian numpy dtype of the shard files."""


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest dtype name that holds every id of the vocab."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def how_to_prepare(path: Path) -> str:
    return f"create it with `kimik3-prepare data.source=<text file|folder|.jsonl> data.prepared_dir={path}`"


class ShardWriter:
    """Writes one split as consecutive shard files of `shard_tokens` tokens (the last may be shorter)."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.dtype = TOKEN_DTYPES[dtype]
        self.shards: list[dict] = []
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._open_next()
            take = min(self.shard_tokens - self._count, tokens.size)
            raw = tokens[:take].tobytes()
            self._file.write(raw)
            self._hash.update(raw)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._close_current()

    def close(self) -> dict:
        """Finish the split; returns its meta.json entry."""
        if self._file is not None:
            self._close_current()
        return {"tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}

    def _open_next(self) -> None:
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self._file = (self.directory / name).open("wb")
        self._hash = hashlib.sha256()
        self._count = 0
        self.shards.append({"file": name})

    def _close_current(self) -> None:
        self._file.close()
        self.shards[-1].update(
            tokens=self._count, bytes=self._count * self.dtype.itemsize, sha256=self._hash.hexdigest()
        )
        self._file = None


def read_meta(path: str | Path) -> dict:
    """meta.json of a prepared dir, checked for format version and dtype-vs-vocab."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"prepared dir {path} does not exist; {how_to_prepare(path)}")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{path} has no {META_FILE}, so it is not a prepared dir; {how_to_prepare(path)}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e.msg}); re-create the dir with kimik3-prepare") from e
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(
            f"{meta_path} has format_version={version!r}; this kimik3 reads {FORMAT_VERSION} "
            f"(re-create the dir with kimik3-prepare)"
        )
    missing = [k for k in _META_FIELDS if k not in meta] + [s for s in SPLITS if s not in meta.get("splits", {})]
    if missing:
        raise DataError(f"{meta_path} lacks {', '.join(missing)}; re-create the dir with kimik3-prepare")
    vocab, dtype = meta["vocab_size"], meta["dtype"]
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"{meta_path} has dtype={dtype!r}; expected one of {', '.join(TOKEN_DTYPES)}")
    if dtype != dtype_for_vocab(vocab):
        raise DataError(f"{meta_path} has dtype={dtype} but vocab_size={vocab} is stored as {dtype_for_vocab(vocab)}")
    return meta


def dataset_identity(meta: dict) -> dict:
    """What must match between a checkpoint and the data it resumes on (small, JSON-able, readable)."""
    return {
        "name": meta["name"],
        "format_version": meta["format_version"],
        "tokenizer": meta["tokenizer"],
        "source_sha256": meta["source"]["sha256"],
        "dtype": meta["dtype"],
        "tokens": {split: meta["splits"][split]["tokens"] for split in SPLITS},
    }


class ShardedTokenDataset:
    """One split of a prepared dir as a flat, random-access token array spread over memmapped shards."""

    def __init__(self, path: str | Path, split: str) -> None:
        if split not in SPLITS:
            raise DataError(f"split={split!r} is not one of {', '.join(SPLITS)}")
        self.path = Path(path)
        self.split = split
        self.meta = read_meta(self.path)
        self.vocab_size: int = self.meta["vocab_size"]
        self.eot_id: int = self.meta["eot_id"]
        self.dtype = TOKEN_DTYPES[self.meta["dtype"]]
        self.shards: list[dict] = self.meta["splits"][split]["shards"]
        self._check_shard_files()
        sizes = [s["tokens"] for s in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # shard i = [starts[i], starts[i+1])
        self.num_tokens = int(self._starts[-1])
        if self.num_tokens != self.meta["splits"][split]["tokens"]:
            raise DataError(
                f"{self.path}/{META_FILE}: {split} shard sizes add up to {self.num_tokens}, not the recorded token count"
            )
        self._maps: dict[int, np.memmap] = {}

    @property
    def identity(self) -> dict:
        return dataset_identity(self.meta)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start+count) as int64, across shard boundaries."""
        if start < 0 or count < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) are outside the {self.split} split ({self.num_tokens})")
        out = np.empty(count, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < count:
            offset = start + done - int(self._starts[shard])
            take = min(count - done, self.shards[shard]["tokens"] - offset)
            out[done : done + take] = self._checked(shard, offset, self._map(shard)[offset : offset + take])
            done += take
            shard += 1
        return out

    def _checked(self, shard: int, offset: int, ids: np.ndarray) -> np.ndarray:
        """`ids` (read from `shard` at `offset`), refused by name when one is past the vocab.

        Bytes damaged in place keep a shard's size, which is all that opening a split checks (hashing
        every shard at each launch would read the whole dataset). Such ids would reach the embedding
        mid-run as an IndexError traceback, or on CUDA as a device-side assert that takes the process's
        CUDA context with it; a max over each batch's few thousand ids costs nothing beside the step."""
        if ids.size and int(ids.max()) >= self.vocab_size:
            at = int(np.argmax(ids >= self.vocab_size))
            raise DataError(
                f"shard {self.path / self.shards[shard]['file']} holds token id {int(ids[at])} at token {offset + at}, "
                f"outside the vocab of {self.vocab_size} ids (corrupt): re-create the dir (`kimik3-prepare "
                f"data.prepared_dir={self.path}` checks every shard against its sha256)"
            )
        return ids

    def verify(self) -> None:
        """Re-hash every shard of the split against meta.json (reads all bytes)."""
        for s in self.shards:
            h = hashlib.sha256()
            with (self.path / s["file"]).open("rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != s["sha256"]:
                raise DataError(
                    f"shard {self.path / s['file']} does not match its sha256 in {META_FILE} (corrupt); re-create the dir"
                )

    def _check_shard_files(self) -> None:
        for s in self.shards:
            f = self.path / s["file"]
            if not f.is_file():
                raise DataError(f"shard {f} listed in {META_FILE} is missing; re-create the dir with kimik3-prepare")
            expected = s["tokens"] * self.dtype.itemsize
            actual = f.stat().st_size
            if actual != expected or s["bytes"] != expected:
                raise DataError(
                    f"shard {f} has {actual} bytes but {META_FILE} says {s['tokens']} tokens x "
                    f"{self.dtype.itemsize} bytes = {expected} (truncated or wrong dtype); re-create the dir"
                )

    def _map(self, shard: int) -> np.memmap:
        m = self._maps.get(shard)
        if m is None:
            m = np.memmap(self.path / self.shards[shard]["file"], dtype=self.dtype, mode="r")
            self._maps[shard] = m
        return m

    def __repr__(self) -> str:
        return (
            f"ShardedTokenDataset({str(self.path)!r}, {self.split!r}: "
            f"{self.num_tokens} tokens, vocab {self.vocab_size})"
        )

