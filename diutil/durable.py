"""Files that are either whole or absent after a crash, a power loss or a full disk.

A file is written beside its final name, flushed to the disk (fsync), renamed over the final name
and the rename itself made durable (fsync of the directory): a reader, after any failure, finds
the previous version or the new one, never a torn one. A write that fails (ENOSPC, EDQUOT, EFBIG
past RLIMIT_FSIZE: Python ignores SIGXFSZ, EIO) removes its temporary file and raises ``OSError`` naming the path; what
was on disk before stays as it was.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(tmp)`` so that it is whole or unchanged after any failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"writing {path} failed: {exc.strerror or exc}") from exc
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike, data: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(data))
