"""Sharded safetensors writing (transformers' layout) and streamed reading back."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="needs pip install 'kimik3[hf]'")  # kimik3.hf imports it

from kimik3.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, ShardedWriter, iter_tensors, shard_files, tensor_names  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(16, 8, generator=g) for i in range(5)} | {"b": torch.arange(3)}


def test_single_shard_has_no_index(tmp_path):
    out = tmp_path / "ckpt"
    with ShardedWriter(out) as w:
        for name, t in _tensors().items():
            w.add(name, t)
        w.extra_files["config.json"] = "{}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]
    back = dict(iter_tensors(out))
    assert back.keys() == _tensors().keys()
    assert all(torch.equal(back[k], v) for k, v in _tensors().items())


def test_sharded_write_has_index_and_round_trips(tmp_path):
    out = tmp_path / "ckpt"
    with ShardedWriter(out, max_shard_bytes=2 * 16 * 8 * 4) as w:  # two fp32 [16, 8] per shard
        for name, t in _tensors().items():
            w.add(name, t)
    index = json.loads((out / INDEX_FILE).read_text())
    files = shard_files(out)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors().values())
    assert set(index["weight_map"]) == set(_tensors())
    assert sorted(tensor_names(out)) == sorted(_tensors())
    back = dict(iter_tensors(out))
    assert all(torch.equal(back[k], v) for k, v in _tensors().items())


def test_shards_get_the_mode_of_any_new_file(tmp_path):
    """safetensors creates its files 0600; an export is for others to read, like config.json beside it."""
    umask = os.umask(0o022)
    try:
        with ShardedWriter(tmp_path / "ckpt", max_shard_bytes=2 * 16 * 8 * 4) as w:
            for name, t in _tensors().items():
                w.add(name, t)
            w.extra_files["config.json"] = "{}"
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ckpt").iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with ShardedWriter(out) as w:
            w.add("a", torch.ones(2))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shards_before", [0, 2], ids=["single", "third-of-three"])
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path, monkeypatch, shards_before):
    """safetensors reports a full disk as a SafetensorError quoting "(os error 28)"; when it hits the last
    shard, written as the dir is published, the temp dir with the shards before it was left behind."""
    import kimik3.hf.safetensors_io as io
    from safetensors import SafetensorError

    from kimik3.write_errors import WriteError

    real_save, calls = io.save_file, []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) <= shards_before:
            return real_save(tensors, path, metadata=metadata)
        Path(path).write_bytes(b"half a shard")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(io, "save_file", save_file)
    out = tmp_path / "ckpt"
    with pytest.raises(WriteError) as err:
        with ShardedWriter(out, max_shard_bytes=2 * 16 * 8 * 4) as w:
            for name, t in _tensors().items():
                w.add(name, t)
    assert str(err.value) == f"cannot write {out}: No space left on device"
    assert len(calls) == shards_before + 1 and list(tmp_path.iterdir()) == []


def test_refuses_nonempty_output_and_duplicate_names(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(FileExistsError, match="not an empty dir"):
        ShardedWriter(tmp_path / "x")
    with pytest.raises(ValueError, match="written twice"):
        with ShardedWriter(tmp_path / "y") as w:
            w.add("a", torch.ones(2))
            w.add("a", torch.ones(2))


def test_missing_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        shard_files(tmp_path)


@pytest.mark.parametrize("read", [tensor_names, lambda d: list(iter_tensors(d))])
def test_a_truncated_shard_is_a_value_error_naming_it(tmp_path, read):
    out = tmp_path / "ckpt"
    with ShardedWriter(out) as w:
        for name, t in _tensors().items():
            w.add(name, t)
    shard = out / SINGLE_FILE
    os.truncate(shard, shard.stat().st_size // 2)  # an interrupted download or copy
    with pytest.raises(ValueError, match=rf"^cannot read {shard}: .*file not fully covered"):
        read(out)


def test_an_index_that_is_not_json_is_a_value_error_naming_it(tmp_path):
    (tmp_path / INDEX_FILE).write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
    with pytest.raises(ValueError, match=rf"^{tmp_path / INDEX_FILE} is not valid JSON: "):
        shard_files(tmp_path)
