"""Writes that fail for want of room or of a writable disk (a full disk, a quota, a file-size limit, a
read-only mount), as one line naming the file.

A full disk reaches kimik3 in several disguises: an OSError from write() that names no file,
torch.save's `RuntimeError: ... unexpected pos 798784 vs 798736` raised while handling that OSError,
safetensors' `I/O error: No space left on device (os error 28)`. `writing(path)` turns each into a
WriteError, `cannot write <path>: No space left on device`, which the commands print as their one
error line. Only these errnos (NO_ROOM) are rewritten: a block may also read (data preparation reads
its source as it writes shards), and a read's ENOENT or EACCES must not be reported as a write of
`path`; other failures pass through unchanged. (No torch import: the run listing tools use this
through runs/metrics.py.)
"""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""The errnos that only a write gets, and that say the disk refuses it."""
_ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)")
"""How Rust libraries (safetensors) quote the OS error behind an I/O failure."""


class WriteError(OSError):
    """`filename` could not be written; str() is one line naming it and the OS's reason."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def errno_of(error: BaseException) -> Optional[int]:
    """The errno behind `error`: its own, that of an OSError it was raised from or while handling,
    or one quoted in its message; None when there is none."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    found = _ERRNO_IN_TEXT.search(str(error))
    return int(found.group(1)) if found else None


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Raise a failed write inside the block as WriteError naming `path` (see the module docstring)."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:  # noqa: BLE001 - only failures with an OS error behind them are rewritten
        code = errno_of(e)
        if code not in NO_ROOM:
            raise
        raise WriteError(code, os.strerror(code), str(path)) from e


__all__ = ["NO_ROOM", "WriteError", "errno_of", "writing"]
