"""kimik3-prepare: the summary, re-verification of an existing dir, and the Hydra app's behaviour
(overrides, one-line errors, nothing written besides the prepared dir)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimik3.config.schema import DataConfig, PrepareConfig
from kimik3.config.store import register_configs
from kimik3.data import DataError
from kimik3 import prepare, train
from kimik3.config.paths import CONF_DIR
from kimik3.prepare import run


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world, hello tokens.\n" * 200, encoding="utf-8")
    return path


def test_run_prints_a_summary_and_verifies_an_existing_dir(tmp_path, corpus, capsys):
    cfg = PrepareConfig(data=DataConfig(source=str(corpus), prepared_dir=str(tmp_path / "p"), val_fraction=0.1))
    path = run(cfg, progress=False)
    out = capsys.readouterr().out
    assert f"prepared dir  {path}  (created" in out
    assert "train         4,861 tokens in 1 shard(s)" in out and "val           540 tokens" in out
    assert "tokenizer     byte, vocab 257, end-of-text id 256, uint16" in out
    run(cfg, progress=False)
    assert "already prepared, checksums verified" in capsys.readouterr().out
    shard = path / "val_000000.bin"
    shard.write_bytes(b"\0\0" + shard.read_bytes()[2:])
    with pytest.raises(DataError, match="val_000000.bin does not match its sha256"):
        run(cfg, progress=False)


def _prepare_cli(cwd, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "kimik3.prepare", *overrides], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_cli_prepares_with_overrides_and_writes_nothing_else(tmp_path, corpus):
    work = tmp_path / "work"
    work.mkdir()
    done = _prepare_cli(work, f"data.source={corpus}", "data.prepared_dir=mine", "data.val_fraction=0.1")
    assert done.returncode == 0, done.stderr
    assert "train         4,861 tokens" in done.stdout
    assert sorted(p.name for p in work.iterdir()) == ["mine"]  # no outputs/, .hydra/ or log file

    bad = _prepare_cli(work, "data.prepared_dir=other", "data.tokenizer=wordpiece")
    assert bad.returncode == 1
    assert bad.stderr.strip() == "kimik3-prepare: error: data.tokenizer='wordpiece' is not one of byte, bpe"


def test_a_data_error_during_tokenizing_starts_its_own_line(tmp_path):
    """The progress bar is closed (its line ended) before the error line is printed, not glued to it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{oops\n')
    done = _prepare_cli(tmp_path, f"data.source={bad}", "data.prepared_dir=p")
    assert done.returncode == 1 and "tokenize bad.jsonl" in done.stderr  # the bar was drawn
    error = f"kimik3-prepare: error: {bad} line 2 is not JSON: Expecting property name enclosed in double quotes"
    assert done.stderr.endswith(f"\n{error}\n"), done.stderr
    assert not (tmp_path / "p").exists()


def test_a_full_disk_is_one_line_and_leaves_no_temp_dir(tmp_path, corpus, monkeypatch, capsys):
    """The disk fills while the val shard is written: one line naming the prepared dir, exit 1, and
    neither the dir nor its temp dir (with the train shard already in it) left behind."""
    from kimik3.data.shards import ShardWriter

    real_open = ShardWriter._open_next

    def open_next(self):
        if self.split == "val":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_open(self)

    monkeypatch.setattr(ShardWriter, "_open_next", open_next)
    monkeypatch.setattr(sys, "argv", ["kimik3-prepare", f"data.source={corpus}", f"data.prepared_dir={tmp_path / 'p'}"])
    with pytest.raises(SystemExit) as done:
        prepare.main()
    assert done.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kimik3-prepare: error: cannot write {tmp_path / 'p'}: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def _compose(*overrides) -> PrepareConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="prepare", overrides=list(overrides)))


def test_data_options_compose_into_the_schema():
    assert _compose().data == DataConfig()
    assert _compose("data=embedded_bpe").data.tokenizer == "bpe"
    assert _compose("data.source=d.jsonl", "data.text_field=body").data == DataConfig(source="d.jsonl", text_field="body")


def test_prepare_and_train_read_the_one_conf_dir():
    assert prepare.CONF_DIR is train.CONF_DIR is CONF_DIR
    assert CONF_DIR.is_absolute() and {"prepare.yaml", "train.yaml"} <= {p.name for p in CONF_DIR.iterdir()}
