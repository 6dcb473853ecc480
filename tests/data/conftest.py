"""Small prepared dirs built from text written into tmp_path (byte tokenizer: token = UTF-8 byte)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimik3.config.schema import DataConfig
from kimik3.data import prepare_data


def _write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def write_text():
    """write_text(path, text) -> path, creating parent folders."""
    return _write_text


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    """~4 KB of varied text: enough for a few small batches."""
    lines = [f"line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5} lazy dogs.\n" for i in range(80)]
    return _write_text(tmp_path / "src" / "corpus.txt", "".join(lines))


@pytest.fixture
def prepared(tmp_path: Path, corpus_file: Path) -> Path:
    """A byte-level prepared dir of corpus_file with small shards (so reads cross shard files)."""
    cfg = DataConfig(source=str(corpus_file), prepared_dir=str(tmp_path / "prepared"), shard_tokens=1000, val_fraction=0.25)
    return prepare_data(cfg, progress=False)
