"""Text sources: a text file, a folder of text files, a JSONL file, or the embedded corpus.

A source is read as a deterministic sequence of documents (str). The **embedded** corpus is this
Python's own standard-library `.py` files: present on every machine, no download. It skips
`site-packages`/`dist-packages` (they differ between machines), `test`/`tests` and `__pycache__`,
walks in sorted relative-path order, and by default reads at most EMBEDDED_MAX_BYTES so the first
preparation takes a few seconds.

Documents: a text file is one document, a folder gives one per file (sorted by relative path,
hidden files skipped), a JSONL file (suffix `.jsonl` in any case) one per line (its `text_field`),
the embedded corpus one per module. `max_source_bytes` cuts the stream after that many UTF-8 bytes
(inside a document if it falls there).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from kimik3.data.errors import DataError

EMBEDDED_MAX_BYTES = 8 * 1024 * 1024
"""Default cap of the embedded corpus (8 MiB, ~8M byte tokens; the whole stdlib is ~12 MB)."""

_EMBEDDED_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


@dataclass(frozen=True)
class Source:
    """A resolved text source: what to read and how to name it."""

    kind: str
    """embedded | text | folder | jsonl"""
    path: Path
    """The file or folder (for embedded: the stdlib folder)."""
    label: str
    """Short readable name, e.g. 'python3.11-stdlib' or 'corpus.txt'."""
    text_field: str
    max_bytes: Optional[int]
    """Cap on UTF-8 bytes read; None reads everything."""

    def files(self) -> list[Path]:
        """The files read, in reading order."""
        if self.kind == "embedded":
            return _walk_sorted(self.path, suffix=".py", skip=_EMBEDDED_SKIP_DIRS)
        if self.kind == "folder":
            return _walk_sorted(self.path, suffix=None, skip=frozenset({"__pycache__"}))
        return [self.path]

    def fingerprint(self) -> dict:
        """Cheap identity (paths, sizes, mtimes; no content read) used to key the cache dir."""
        # Hashed, so a folder of a million files still gives a small key (it is stored in meta.json).
        stats = hashlib.sha256()
        files = self.files()
        for p in files:
            st = p.stat()
            rel = p.name if p == self.path else p.relative_to(self.path).as_posix()
            stats.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        key = {"kind": self.kind, "path": str(self.path), "max_bytes": self.max_bytes,
               "files": {"count": len(files), "sha256": stats.hexdigest()}}
        if self.kind == "jsonl":
            key["text_field"] = self.text_field
        if self.kind == "embedded":
            key["python"] = sys.version.split()[0]
        return key

    def size_hint(self) -> Optional[int]:
        """Bytes that will be read, for progress bars (None for JSONL, whose text size is unknown)."""
        if self.kind == "jsonl":
            return self.max_bytes
        total = sum(p.stat().st_size for p in self.files())
        return total if self.max_bytes is None else min(total, self.max_bytes)

    def documents(self) -> Iterator[str]:
        """Documents in order, cut at max_bytes."""
        budget = self.max_bytes
        for doc in self._raw_documents():
            if budget is not None:
                raw = doc.encode("utf-8")
                if len(raw) >= budget:
                    if budget > 0:
                        yield raw[:budget].decode("utf-8", errors="ignore")
                    return
                budget -= len(raw)
            yield doc

    def _raw_documents(self) -> Iterator[str]:
        if self.kind == "jsonl":
            yield from _jsonl_documents(self.path, self.text_field)
            return
        for path in self.files():
            # Embedded sources are read leniently (a stray Latin-1 byte must not stop the default
            # run); user files must be UTF-8 so a wrong file is noticed.
            yield _read_text(path, strict=self.kind != "embedded")


def resolve_source(source: Optional[str], *, text_field: str, max_source_bytes: Optional[int]) -> Source:
    """Turn data.source into a Source; None selects the embedded corpus."""
    if max_source_bytes is not None and max_source_bytes <= 0:
        raise DataError(f"data.max_source_bytes={max_source_bytes} must be positive (or null for no cap)")
    if source is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        label = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
        cap = EMBEDDED_MAX_BYTES if max_source_bytes is None else max_source_bytes
        return Source("embedded", stdlib, label, text_field, cap)
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise DataError(
            f"data.source={source} does not exist (expected a text file, a folder of text files or a .jsonl)"
        )
    if path.is_dir():
        kind = "folder"
    elif path.suffix.lower() == ".jsonl":  # DOCS.JSONL too: a case-sensitive match read it as one text document
        kind = "jsonl"
    else:
        kind = "text"
    return Source(kind, path, path.name, text_field, max_source_bytes)


def _walk_sorted(root: Path, *, suffix: Optional[str], skip: frozenset[str]) -> list[Path]:
    """Regular files under root, sorted by relative posix path; hidden entries and `skip` dirs pruned."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(dirpath, name)
            if not path.exists():
                raise DataError(f"{path} is a dangling symlink; fix it or remove it from data.source")
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path, *, strict: bool) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); convert it or remove it from data.source") from e


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {lineno} is not UTF-8 text (byte {e.start}); convert the file") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno} is not JSON: {e.msg}") from e
            if not isinstance(row, dict) or text_field not in row:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise DataError(f"{path} line {lineno} has no {text_field!r} field (has: {keys}); set data.text_field")
            text = row[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path} line {lineno}: field {text_field!r} is {type(text).__name__}, not a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON allows a lone surrogate escape (\ud800), which no tokenizer can take
                raise DataError(f"{path} line {lineno}: field {text_field!r} holds a lone surrogate "
                                f"({text[e.start]!a}), not text") from e
            yield text
