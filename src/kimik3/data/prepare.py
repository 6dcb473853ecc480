"""prepare_data: text source -> prepared dir of token shards, once, atomically, concurrency-safe.

Where the dir goes:
- data.prepared_dir set and already prepared: used as it is; when data.source is also set, the
  dir must have been prepared from that source with the same settings, else a one-line error.
- data.prepared_dir set, not prepared: prepared from data.source; without a source this is an
  error that says how to create it (a typo must not silently train on the embedded corpus).
- data.prepared_dir unset: a cache dir <cache>/data/<label>-<tokenizer>-<key>, where <cache> is
  data.cache_dir, $KIMIK3_CACHE or ~/.cache/kimik3 and <key> hashes the source (paths, sizes,
  mtimes), tokenizer and settings. Later calls with the same inputs reuse it.

Preparation writes into a fresh temp dir beside the target and renames it into place (atomic on
POSIX), so a reader never sees a half-written dir. When two processes race, the first rename wins
and the loser deletes its copy and uses the winner's.

Split: all documents (each followed by end-of-text) form one token stream; val is its last
round(val_fraction * tokens) tokens, train everything before (a cut at a token, deterministic).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from tqdm.auto import tqdm

import kimik3
from kimik3.config.schema import DataConfig
from kimik3.data.corpus import Source, resolve_source
from kimik3.data.errors import DataError
from kimik3.data.shards import (
    FORMAT_VERSION, META_FILE, SPLITS, TOKEN_DTYPES, ShardWriter, dtype_for_vocab, read_meta,
)
from kimik3.data.tokenizer import TOKENIZER_FILE, BpeTokenizer, ByteTokenizer, Tokenizer, check_tokenizer_choice
from kimik3.write_errors import writing

_ENCODE_BATCH_BYTES = 1 << 20
"""Documents are tokenized in batches of about this many characters (BPE encodes a batch in parallel)."""


def prepare_data(cfg: DataConfig, *, progress: bool = True) -> Path:
    """The prepared dir for `cfg`, preparing it first when needed (see the module docstring)."""
    if cfg.prepared_dir is not None and cfg.source is None and not (Path(cfg.prepared_dir) / META_FILE).is_file():
        read_meta(Path(cfg.prepared_dir))  # raises: missing dir / not a prepared dir, with the command to create it
    return prepare_or_reuse(cfg, progress=progress)[0]


def prepare_or_reuse(cfg: DataConfig, *, progress: bool = True) -> tuple[Path, bool]:
    """kimik3-prepare's entry: like prepare_data, but data.prepared_dir alone (no data.source) may
    be created from the embedded corpus. Returns (dir, created)."""
    source, request = _resolve(cfg)
    target = cache_target(cfg, source, request) if cfg.prepared_dir is None else Path(cfg.prepared_dir)
    return _reuse_or_build(cfg, source, request, target, progress=progress)


def cache_target(cfg: DataConfig, source: Source, request: dict) -> Path:
    """<cache>/data/<label>-<tokenizer>-<first 12 hex of the request hash>."""
    return cache_root(cfg) / "data" / f"{source.label}-{cfg.tokenizer}-{request_hash(request)[:12]}"


def _reuse_or_build(
    cfg: DataConfig, source: Source, request: dict, target: Path, *, progress: bool
) -> tuple[Path, bool]:
    """An existing prepared dir must match the request; a missing one is built. Returns (dir, created)."""
    if (target / META_FILE).is_file():
        if cfg.source is not None or cfg.prepared_dir is None:
            check_request(target, request)
        else:
            read_meta(target)  # data.prepared_dir alone names an existing dir: use it as it is
        return target, False
    return build_prepared_dir(cfg, source, request, target, progress=progress), True


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    env = os.environ.get("KIMIK3_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kimik3"


def _resolve(cfg: DataConfig) -> tuple[Source, dict]:
    """Check the data options and compute the request: everything the prepared bytes depend on."""
    check_tokenizer_choice(cfg.tokenizer, cfg.tokenizer_path)
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    if cfg.shard_tokens < 1:
        raise DataError(f"data.shard_tokens={cfg.shard_tokens} must be >= 1")
    source = resolve_source(cfg.source, text_field=cfg.text_field, max_source_bytes=cfg.max_source_bytes)
    tokenizer: dict = {"name": cfg.tokenizer}
    if cfg.tokenizer_path is not None:
        path = Path(cfg.tokenizer_path).expanduser().resolve()
        if not path.is_file():
            raise DataError(f"data.tokenizer_path={cfg.tokenizer_path} does not exist (expected a tokenizer.json)")
        tokenizer["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    elif cfg.tokenizer == "bpe":
        tokenizer["trained_vocab_size"] = cfg.bpe_vocab_size
    request = {
        "format_version": FORMAT_VERSION,
        "source": source.fingerprint(),
        "tokenizer": tokenizer,
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
    }
    return source, json.loads(json.dumps(request))  # tuples -> lists, as meta.json will hold it


def request_hash(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode("utf-8")).hexdigest()


def check_request(target: Path, request: dict) -> None:
    """Refuse a prepared dir made from another source or with other settings than requested."""
    recorded = read_meta(target).get("request", {})
    difference = _first_difference(recorded, request)
    if difference is not None:
        raise DataError(
            f"{target} was prepared with other inputs than requested now ({difference}); "
            f"delete it or choose another data.prepared_dir"
        )


def _first_difference(then: dict, now: dict, prefix: str = "") -> Optional[str]:
    """'key: then -> now' for the first differing leaf, scalars before nested dicts."""
    for key in sorted(set(then) | set(now), key=lambda k: (isinstance(now.get(k), dict), k)):
        a, b = then.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found = _first_difference(a, b, prefix=f"{name}.")
            if found is not None:
                return found
        elif a != b:
            if name == "source.files.sha256":
                return "source files added, removed, resized or touched since"
            return f"{name}: {a!r} then, {b!r} now"
    return None


def build_prepared_dir(cfg: DataConfig, source: Source, request: dict, target: Path, *, progress: bool) -> Path:
    """Prepare into a temp dir beside `target`, then rename it into place (see module docstring).
    A full disk is a WriteError naming `target`, and the temp dir goes with every shard in it."""
    target = target.absolute()
    if (target / META_FILE).is_file():
        return target  # another process published it since the caller looked
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DataError(f"{target} exists but is not a prepared dir (no {META_FILE}); delete it or choose another path")
    with writing(target):
        _build_into(cfg, source, request, target, progress=progress)
    return target


def _build_into(cfg: DataConfig, source: Source, request: dict, target: Path, *, progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_prepared(tmp, cfg, source, request, progress=progress)
        try:
            os.rename(tmp, target)  # atomic; fails when target is a non-empty dir
        except OSError:
            if not (target / META_FILE).is_file():
                raise
            # Another process finished first: keep its dir (same request, same bytes).
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_prepared(out: Path, cfg: DataConfig, source: Source, request: dict, *, progress: bool) -> None:
    tok = _make_tokenizer(cfg, source, progress=progress)
    if isinstance(tok, BpeTokenizer):
        tok.save(out / TOKENIZER_FILE)
    dtype = dtype_for_vocab(tok.vocab_size)

    # Pass 1: documents -> one token stream file (total length unknown until the end).
    stream_path = out / "stream.tmp"
    stats = _tokenize_to_stream(source, tok, stream_path, dtype, progress=progress)
    if stats["bytes"] == 0:
        raise DataError(f"data.source={source.path} ({source.kind}) has no text: nothing to prepare")

    # Pass 2: cut the stream into train = [0, n - n_val) and val = [n - n_val, n), each sharded.
    stream = np.memmap(stream_path, dtype=TOKEN_DTYPES[dtype], mode="r")
    n = stream.size
    n_val = int(round(n * cfg.val_fraction))
    bounds = {"train": (0, n - n_val), "val": (n - n_val, n)}
    splits = {}
    for split in SPLITS:
        writer = ShardWriter(out, split, dtype, cfg.shard_tokens)
        lo, hi = bounds[split]
        for start in range(lo, hi, 1 << 24):
            writer.write(stream[start : min(hi, start + (1 << 24))])
        splits[split] = writer.close()
    del stream
    stream_path.unlink()

    meta = {
        "format": "kimik3-tokens",
        "format_version": FORMAT_VERSION,
        "name": f"{source.label}/{tok.name}-{tok.vocab_size}",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kimik3_version": kimik3.__version__,
        "source": {"kind": source.kind, "path": str(source.path), "label": source.label,
                   "max_bytes": source.max_bytes, **stats},
        "tokenizer": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype,
        "byte_order": "little",
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
        "splits": splits,
        "request": request,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _make_tokenizer(cfg: DataConfig, source: Source, *, progress: bool) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer_path is not None:
        return BpeTokenizer.from_file(cfg.tokenizer_path)
    return BpeTokenizer.train(source.documents(), cfg.bpe_vocab_size, progress=progress)


def _tokenize_to_stream(source: Source, tok: Tokenizer, path: Path, dtype: str, *, progress: bool) -> dict:
    """Append every document's tokens + end-of-text to `path`; returns source stats for meta.json."""
    np_dtype = TOKEN_DTYPES[dtype]
    text_hash = hashlib.sha256()
    documents = n_bytes = 0
    # The bar is closed (its line ended) however the loop ends: a DataError from a bad document must
    # print on its own line, not glued to the bar's.
    with tqdm(total=source.size_hint(), unit="B", unit_scale=True, desc=f"tokenize {source.label}",
              disable=not progress) as bar, path.open("wb") as f:
        for batch in _batches(source.documents()):
            for doc, ids in zip(batch, tok.encode_batch(batch)):
                raw = doc.encode("utf-8")
                text_hash.update(raw)
                text_hash.update(b"\0")  # document boundaries are part of the fingerprint
                n_bytes += len(raw)
                documents += 1
                f.write(ids.astype(np_dtype).tobytes())
                f.write(np.array([tok.eot_id], dtype=np_dtype).tobytes())
                bar.update(len(raw))
    return {"documents": documents, "bytes": n_bytes, "sha256": text_hash.hexdigest()}


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= _ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
