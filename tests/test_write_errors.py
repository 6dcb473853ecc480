"""write_errors.writing: which failures become a one-line WriteError naming the file, and which pass."""

from __future__ import annotations

import errno
import os

import pytest

from kimik3.write_errors import WriteError, writing


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _torch_style() -> None:
    """torch.save on a full disk: a RuntimeError raised while handling the ENOSPC, naming neither."""
    try:
        raise _enospc()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 798784 vs 798736")


def _rust_style() -> None:
    """safetensors on a full disk: the errno only quoted in the message."""
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")


def _plain_write() -> None:
    """A write() on a full disk: an OSError that names no file."""
    raise _enospc()


def _read_only() -> None:
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


@pytest.mark.parametrize("fail", [_torch_style, _rust_style, _plain_write, _read_only],
                         ids=["torch", "safetensors", "plain-write", "read-only"])
def test_a_refused_write_becomes_one_line_naming_the_file(tmp_path, fail):
    with pytest.raises(WriteError) as err:
        with writing(tmp_path / "out.pt"):
            fail()
    reason = "Read-only file system" if fail is _read_only else "No space left on device"
    assert str(err.value) == f"cannot write {tmp_path / 'out.pt'}: {reason}"
    assert isinstance(err.value, OSError) and err.value.filename == str(tmp_path / "out.pt")


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "No such file or directory", "src.txt"),
                                   PermissionError(errno.EACCES, "Permission denied", "src.txt"),
                                   OSError("disk full"), RuntimeError("boom")],
                         ids=["missing-source", "unreadable-source", "no-errno", "not-io"])
def test_other_failures_pass_through_unchanged(tmp_path, error):
    """A block may read too (preparation reads its source while it writes shards): a read's error is
    not reported as a write of the block's path."""
    with pytest.raises(type(error)) as err:
        with writing(tmp_path / "out"):
            raise error
    assert err.value is error
