"""Prepared-dir format: meta.json contents, shard reads, and detection of corrupt or mismatched shards."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from kimik3.data import DataError, ShardedTokenDataset
from kimik3.data.shards import FORMAT_VERSION, ShardWriter, dtype_for_vocab


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def _edit_meta(path, edit):
    meta = _meta(path)
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_meta_records_format_tokenizer_dtype_counts_and_checksums(prepared, corpus_file):
    meta = _meta(prepared)
    text = corpus_file.read_bytes()
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["name"] == "corpus.txt/byte-257"
    assert meta["tokenizer"] == {"name": "byte", "vocab_size": 257, "eot_id": 256}
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"], meta["byte_order"]) == (257, 256, "uint16", "little")
    assert meta["source"]["documents"] == 1 and meta["source"]["bytes"] == len(text)
    assert meta["source"]["sha256"] == hashlib.sha256(text + b"\0").hexdigest()
    total = len(text) + 1  # one document + its end-of-text token
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert val["tokens"] == round(0.25 * total) and train["tokens"] + val["tokens"] == total
    for split in (train, val):
        assert [s["tokens"] for s in split["shards"]][:-1] == [1000] * (len(split["shards"]) - 1)
        for s in split["shards"]:
            data = (prepared / s["file"]).read_bytes()
            assert s["bytes"] == len(data) == 2 * s["tokens"]
            assert s["sha256"] == hashlib.sha256(data).hexdigest()


def test_splits_are_the_token_stream_cut_once(prepared, corpus_file):
    train, val = ShardedTokenDataset(prepared, "train"), ShardedTokenDataset(prepared, "val")
    stream = np.concatenate([train.read(0, train.num_tokens), val.read(0, val.num_tokens)])
    assert stream.tolist() == list(corpus_file.read_bytes()) + [256]
    assert stream.dtype == np.int64
    # A read across the shard boundary at 1000 equals the pieces on either side.
    assert train.read(990, 20).tolist() == stream[990:1010].tolist()
    with pytest.raises(IndexError):
        train.read(train.num_tokens - 1, 2)


def test_identity_is_small_readable_and_split_independent(prepared):
    ident = ShardedTokenDataset(prepared, "train").identity
    assert ident == ShardedTokenDataset(prepared, "val").identity
    assert ident["name"] == "corpus.txt/byte-257" and set(ident["tokens"]) == {"train", "val"}
    assert len(json.dumps(ident)) < 400


def test_truncated_shard_is_detected(prepared):
    shard = prepared / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train_000001.bin has \d+ bytes but meta.json says \d+ tokens x 2 bytes"):
        ShardedTokenDataset(prepared, "train")
    ShardedTokenDataset(prepared, "val")  # the other split is still readable


def test_missing_shard_is_detected(prepared):
    (prepared / "val_000000.bin").unlink()
    with pytest.raises(DataError, match=r"shard .*val_000000.bin listed in meta.json is missing"):
        ShardedTokenDataset(prepared, "val")


def test_wrong_dtype_in_meta_is_detected(prepared):
    _edit_meta(prepared, lambda m: m.update(dtype="uint32"))
    with pytest.raises(DataError, match="dtype=uint32 but vocab_size=257 is stored as uint16"):
        ShardedTokenDataset(prepared, "train")
    _edit_meta(prepared, lambda m: m.update(dtype="int8"))
    with pytest.raises(DataError, match="dtype='int8'; expected one of uint16, uint32"):
        ShardedTokenDataset(prepared, "train")


def test_unknown_format_version_missing_fields_and_bad_json_are_refused(prepared):
    _edit_meta(prepared, lambda m: m.update(format_version=99))
    with pytest.raises(DataError, match=f"format_version=99; this kimik3 reads {FORMAT_VERSION}"):
        ShardedTokenDataset(prepared, "train")
    _edit_meta(prepared, lambda m: (m.update(format_version=FORMAT_VERSION), m.pop("dtype"), m["splits"].pop("val")))
    with pytest.raises(DataError, match="meta.json lacks dtype, val; re-create"):
        ShardedTokenDataset(prepared, "train")
    (prepared / "meta.json").write_text("{")
    with pytest.raises(DataError, match="meta.json is not valid JSON"):
        ShardedTokenDataset(prepared, "train")


def test_flipped_byte_passes_the_size_check_but_fails_verify(prepared):
    shard = prepared / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    ds = ShardedTokenDataset(prepared, "train")
    with pytest.raises(DataError, match="does not match its sha256"):
        ds.verify()
    ShardedTokenDataset(prepared, "val").verify()


def test_an_id_past_the_vocab_is_refused_by_name_when_read(prepared):
    """Bytes overwritten in place (the size still right) with an id past the vocab: opening the split
    cannot tell, the read that meets it refuses it by shard and position (not an IndexError in the
    model's embedding mid-run); the rest of the split still reads."""
    shard = prepared / "train_000001.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[7] = 65535
    ids.tofile(shard)
    ds = ShardedTokenDataset(prepared, "train")
    with pytest.raises(DataError) as err:
        ds.read(990, 20)  # across the boundary at 1000: the bad id is the read's 18th
    assert str(err.value) == (
        f"shard {shard} holds token id 65535 at token 7, outside the vocab of 257 ids (corrupt): re-create the "
        f"dir (`kimik3-prepare data.prepared_dir={prepared}` checks every shard against its sha256)")
    assert ds.read(0, 1000).max() < 257 and ds.read(1008, 10).max() < 257


def test_missing_dir_and_non_prepared_dir_say_how_to_create_them(tmp_path):
    with pytest.raises(DataError, match=r"prepared dir .*nowhere does not exist; create it with `kimik3-prepare data.source="):
        ShardedTokenDataset(tmp_path / "nowhere", "train")
    with pytest.raises(DataError, match="has no meta.json, so it is not a prepared dir; create it with"):
        ShardedTokenDataset(tmp_path, "train")
    with pytest.raises(DataError, match="split='test' is not one of train, val"):
        ShardedTokenDataset(tmp_path, "test")


def test_uint32_shards_round_trip_ids_above_65535(tmp_path):
    assert (dtype_for_vocab(65536), dtype_for_vocab(65537)) == ("uint16", "uint32")
    ids = np.array([0, 65535, 65536, 99_999, 7], dtype=np.int64)
    splits = {}
    for split, part in (("train", ids), ("val", ids[:2])):
        writer = ShardWriter(tmp_path, split, "uint32", shard_tokens=3)
        writer.write(part)
        splits[split] = writer.close()
    meta = {"format_version": FORMAT_VERSION, "name": "hand/bpe-100000", "vocab_size": 100_000, "eot_id": 7,
            "dtype": "uint32", "tokenizer": {"name": "bpe"}, "source": {"sha256": "0"}, "splits": splits}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    ds = ShardedTokenDataset(tmp_path, "train")
    assert [s["tokens"] for s in ds.shards] == [3, 2]
    assert ds.read(0, 5).tolist() == ids.tolist()
    assert (tmp_path / "train_000000.bin").read_bytes()[4:8] == (65535).to_bytes(4, "little")
