"""prepare_data: sources -> prepared dirs, the cache, request checks, and atomic/concurrent safety."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kimik3.config.schema import DataConfig
from kimik3.data import DataError, ShardedTokenDataset, load_tokenizer, prepare_data
from kimik3.data import prepare as prepare_mod
from kimik3.data.tokenizer import EOT_TEXT, BpeTokenizer


def _all_tokens(path):
    parts = [ShardedTokenDataset(path, s) for s in ("train", "val")]
    return [t for ds in parts for t in ds.read(0, ds.num_tokens).tolist()]


def _cfg(tmp_path, source, **kw):
    return DataConfig(source=str(source), prepared_dir=str(tmp_path / kw.pop("name", "out")), **kw)


def test_folder_and_jsonl_documents_are_each_followed_by_end_of_text(tmp_path, write_text):
    write_text(tmp_path / "docs" / "1.txt", "first")
    write_text(tmp_path / "docs" / "2.txt", "second")
    jsonl = write_text(tmp_path / "d.jsonl", '{"text": "first"}\n{"text": "second"}\n')
    expected = list(b"first") + [256] + list(b"second") + [256]
    for source, name in ((tmp_path / "docs", "f"), (jsonl, "j")):
        path = prepare_data(_cfg(tmp_path, source, name=name, val_fraction=0.0), progress=False)
        assert _all_tokens(path) == expected
        assert load_tokenizer(path).decode(expected) == f"first{EOT_TEXT}second{EOT_TEXT}"
        meta = json.loads((path / "meta.json").read_text())
        assert meta["source"]["documents"] == 2 and meta["splits"]["val"] == {"tokens": 0, "shards": []}


def test_explicit_dir_is_reused_and_a_changed_request_is_refused(tmp_path, corpus_file):
    cfg = _cfg(tmp_path, corpus_file, val_fraction=0.25)
    path = prepare_data(cfg, progress=False)
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert prepare_data(cfg, progress=False) == path and (path / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match=r"prepared with other inputs than requested now \(val_fraction: 0.25 then, 0.5 now\)"):
        prepare_data(_cfg(tmp_path, corpus_file, val_fraction=0.5), progress=False)
    corpus_file.write_text(corpus_file.read_text() + "more")
    with pytest.raises(DataError, match=r"\(source files added, removed, resized or touched since\)"):
        prepare_data(cfg, progress=False)
    # data.prepared_dir alone names an existing dir: used as it is, whatever made it.
    assert prepare_data(DataConfig(prepared_dir=str(path)), progress=False) == path


def test_missing_prepared_dir_without_source_says_how_to_create_it(tmp_path):
    with pytest.raises(DataError, match=r"prepared dir .*mine does not exist; create it with `kimik3-prepare data.source="):
        prepare_data(DataConfig(prepared_dir=str(tmp_path / "mine")), progress=False)


def test_cache_dir_is_keyed_by_source_and_settings(tmp_path, corpus_file, monkeypatch):
    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path / "envcache"))
    a = prepare_data(DataConfig(source=str(corpus_file)), progress=False)
    assert a.parent == tmp_path / "envcache" / "data" and a.name.startswith("corpus.txt-byte-")
    b = prepare_data(DataConfig(source=str(corpus_file), cache_dir=str(tmp_path / "c")), progress=False)
    assert b.parent == tmp_path / "c" / "data" and b.name == a.name
    c = prepare_data(DataConfig(source=str(corpus_file), cache_dir=str(tmp_path / "c"), val_fraction=0.1), progress=False)
    assert c != b and _all_tokens(c) == _all_tokens(b)


def test_embedded_corpus_prepares_into_the_cache_once(tmp_path, monkeypatch):
    cfg = DataConfig(cache_dir=str(tmp_path), max_source_bytes=50_000)
    path = prepare_data(cfg, progress=False)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["name"].startswith("python3.") and meta["name"].endswith("-stdlib/byte-257")
    assert meta["source"]["kind"] == "embedded" and meta["source"]["bytes"] == 50_000
    assert len(_all_tokens(path)) == 50_000 + meta["source"]["documents"]

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt a prepared cache dir")

    monkeypatch.setattr(prepare_mod, "build_prepared_dir", must_not_build)
    assert prepare_data(cfg, progress=False) == path


def test_bpe_trained_and_loaded_tokenizers(tmp_path, corpus_file):
    trained = prepare_data(_cfg(tmp_path, corpus_file, name="t", tokenizer="bpe", bpe_vocab_size=300), progress=False)
    tok = load_tokenizer(trained)
    assert isinstance(tok, BpeTokenizer) and tok.vocab_size <= 300
    assert tok.decode(_all_tokens(trained)) == corpus_file.read_text() + EOT_TEXT
    meta = json.loads((trained / "meta.json").read_text())
    assert meta["tokenizer"] == tok.identity and meta["vocab_size"] == tok.vocab_size
    loaded = prepare_data(
        _cfg(tmp_path, corpus_file, name="l", tokenizer="bpe", tokenizer_path=str(trained / "tokenizer.json")),
        progress=False,
    )
    assert _all_tokens(loaded) == _all_tokens(trained)
    assert json.loads((loaded / "meta.json").read_text())["tokenizer"] == meta["tokenizer"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tokenizer": "wordpiece"}, "data.tokenizer='wordpiece' is not one of byte, bpe"),
        ({"val_fraction": 1.0}, r"data.val_fraction=1.0 must be in \[0, 1\)"),
        ({"shard_tokens": 0}, "data.shard_tokens=0 must be >= 1"),
        ({"tokenizer": "bpe", "tokenizer_path": "nope.json"}, "data.tokenizer_path=nope.json does not exist"),
    ],
    ids=["tokenizer", "val_fraction", "shard_tokens", "tokenizer_path"],
)
def test_bad_options_are_one_line_errors(tmp_path, corpus_file, overrides, message):
    with pytest.raises(DataError, match=message):
        prepare_data(_cfg(tmp_path, corpus_file, **overrides), progress=False)


def test_empty_source_fails_and_leaves_nothing_behind(tmp_path, write_text):
    (tmp_path / "empty").mkdir()
    empty_file = write_text(tmp_path / "e.txt", "")
    for source in (tmp_path / "empty", empty_file):
        with pytest.raises(DataError, match="has no text: nothing to prepare"):
            prepare_data(DataConfig(source=str(source), prepared_dir=str(tmp_path / "out")), progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_non_prepared_target_is_not_overwritten(tmp_path, corpus_file, write_text):
    write_text(tmp_path / "out" / "notes.txt", "mine")
    with pytest.raises(DataError, match="exists but is not a prepared dir"):
        prepare_data(_cfg(tmp_path, corpus_file), progress=False)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_stale_temp_dir_and_empty_target_do_not_break_prepare(tmp_path, corpus_file, write_text):
    write_text(tmp_path / ".out.tmp-crashed" / "stream.tmp", "half")  # left by a killed process
    (tmp_path / "out").mkdir()  # an empty dir is replaced by the rename
    path = prepare_data(_cfg(tmp_path, corpus_file), progress=False)
    ShardedTokenDataset(path, "train").verify()


def test_losing_a_race_uses_the_winners_dir(tmp_path, corpus_file, monkeypatch):
    """Another process publishes the target while we write our temp copy: our rename fails,
    we delete the copy and return the winner's dir."""
    real_write = prepare_mod._write_prepared
    target = tmp_path / "out"

    def write_and_lose(out, *args, **kwargs):
        real_write(out, *args, **kwargs)
        target.mkdir()
        real_write(target, *args, **kwargs)  # the winner's complete dir appears first
        (target / "winner").write_text("")

    monkeypatch.setattr(prepare_mod, "_write_prepared", write_and_lose)
    path = prepare_data(_cfg(tmp_path, corpus_file), progress=False)
    assert path == target and (path / "winner").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_two_processes_preparing_the_same_cache_agree(tmp_path):
    code = (
        "import sys; from kimik3.config.schema import DataConfig; from kimik3.data import prepare_data, "
        "ShardedTokenDataset as D; p = prepare_data(DataConfig(cache_dir=sys.argv[1], max_source_bytes=300_000), "
        "progress=False); D(p, 'train').verify(); print(p)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "data").iterdir()] == [outs[0].rsplit("/", 1)[1]]
