"""Text sources: kinds, document order, byte cap, JSONL field errors, the embedded corpus."""

from __future__ import annotations

import json

import pytest

from kimik3.data.corpus import EMBEDDED_MAX_BYTES, resolve_source
from kimik3.data.errors import DataError


def _source(path, **kw):
    return resolve_source(str(path), text_field=kw.pop("text_field", "text"), max_source_bytes=kw.pop("cap", None))


def test_kind_by_path(tmp_path, write_text):
    assert _source(write_text(tmp_path / "a.txt", "x")).kind == "text"
    assert _source(write_text(tmp_path / "b.jsonl", '{"text": "x"}\n')).kind == "jsonl"
    assert _source(tmp_path).kind == "folder"
    for name in ("c.JSONL", "d.Jsonl"):  # the suffix in any case
        upper = _source(write_text(tmp_path / name, '{"text": "x"}\n'))
        assert (upper.kind, list(upper.documents())) == ("jsonl", ["x"])
    assert _source(write_text(tmp_path / "e.TXT", '{"text": "x"}\n')).kind == "text"
    with pytest.raises(DataError, match=r"data.source=.*nope.txt does not exist"):
        _source(tmp_path / "nope.txt")


def test_folder_is_one_document_per_file_in_sorted_relative_order(tmp_path, write_text):
    write_text(tmp_path / "b.txt", "B")
    write_text(tmp_path / "a" / "z.md", "AZ")
    write_text(tmp_path / "a.txt", "A")
    write_text(tmp_path / ".hidden", "H")
    write_text(tmp_path / ".git" / "x", "G")
    assert list(_source(tmp_path).documents()) == ["A", "AZ", "B"]  # "a.txt" < "a/z.md" < "b.txt" (posix paths)


def test_folder_with_non_utf8_file_names_it(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError, match=r"bad.txt is not UTF-8 text"):
        list(_source(tmp_path).documents())


@pytest.mark.parametrize("line, message", [
    (b'{"text": "a \xff"}\n', r"bad.jsonl line 2 is not UTF-8 text \(byte 12\); convert the file"),
    (b'{"text": "bad \\ud800"}\n', r"bad.jsonl line 2: field 'text' holds a lone surrogate \('\\ud800'\), not text"),
], ids=["not-utf8", "lone-surrogate"])
def test_jsonl_that_is_not_text_names_the_file_and_line(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n' + line)
    docs = _source(tmp_path / "bad.jsonl").documents()
    assert next(docs) == "fine"
    with pytest.raises(DataError, match=message):
        next(docs)


def test_folder_with_a_dangling_symlink_names_it(tmp_path, write_text):
    write_text(tmp_path / "a.txt", "A")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(DataError, match=r"gone.txt is a dangling symlink; fix it or remove it from data.source"):
        list(_source(tmp_path).documents())


def test_jsonl_documents_and_field_errors(tmp_path, write_text):
    rows = [{"text": "one", "id": 1}, {"body": "two"}]
    path = write_text(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = _source(path).documents()
    assert next(docs) == "one"
    with pytest.raises(DataError, match=r"d.jsonl line 2 has no 'text' field \(has: body\); set data.text_field"):
        next(docs)
    assert list(_source(write_text(tmp_path / "e.jsonl", '{"body": "b"}\n'), text_field="body").documents()) == ["b"]
    with pytest.raises(DataError, match="line 1 is not JSON"):
        list(_source(write_text(tmp_path / "f.jsonl", "{oops\n")).documents())
    with pytest.raises(DataError, match="'text' is int, not a string"):
        list(_source(write_text(tmp_path / "g.jsonl", '{"text": 3}\n')).documents())


def test_max_bytes_cuts_the_stream_at_a_byte_count(tmp_path, write_text):
    write_text(tmp_path / "a.txt", "aaaa")
    write_text(tmp_path / "b.txt", "bbbb")
    write_text(tmp_path / "c.txt", "cccc")
    assert list(_source(tmp_path, cap=6).documents()) == ["aaaa", "bb"]
    assert list(_source(tmp_path, cap=8).documents()) == ["aaaa", "bbbb"]
    # A multi-byte character cut in half is dropped, not turned into garbage.
    assert list(_source(write_text(tmp_path / "u.txt", "é"), cap=1).documents()) == [""]
    with pytest.raises(DataError, match="max_source_bytes=0 must be positive"):
        _source(tmp_path, cap=0)


def test_embedded_corpus_is_stdlib_python_without_site_packages_or_tests():
    src = resolve_source(None, text_field="text", max_source_bytes=None)
    assert src.kind == "embedded" and src.max_bytes == EMBEDDED_MAX_BYTES
    files = src.files()
    rel = [f.relative_to(src.path).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any(part in ("site-packages", "test", "tests") for r in rel for part in r.split("/"))
    docs = list(resolve_source(None, text_field="text", max_source_bytes=5000).documents())
    assert sum(len(d.encode()) for d in docs) == 5000
