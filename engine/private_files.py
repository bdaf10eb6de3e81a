"""Private directories and files for everything k3chat writes (checkpoints, reports, JSON).

Every directory we create is 0700 and every file we write 0600, whatever the umask: the
XDG base directory rule for the directories, and one rule for all outputs so that nobody
has to decide per file whether it may hold something private (a `--json` report names the
model and the machine; a history holds conversations). Directories that already exist are
left as they are: they belong to the user (a shared ~/.cache, a mount point).

Only the standard library, so both `k3engine` and `k3chat` can use it.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "TEMP_RE", "UnsafePathError", "atomic_write",
           "fsync_dir", "make_private_dirs", "open_private", "private_open", "temp_name",
           "write_all", "write_private"]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UnsafePathError(OSError):
    """A path we must keep private is not ours or cannot be made private."""


def make_private_dirs(path: Path | str) -> Path:
    """Create `path` and each missing parent as a 0700 directory (like `mkdir -p -m 700`).

    Existing directories are not changed. The mode is set again after mkdir because the
    umask can remove bits (a umask of 0277 would otherwise leave us a 0500 directory)."""
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # another process made it meanwhile: theirs, like any existing one
        os.chmod(directory, PRIVATE_DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def open_private(path: Path | str, buffering: int = -1) -> BinaryIO:
    """Open `path` for writing (created or truncated) as a 0600 file; a symlink is refused.

    A looser existing file is tightened before anything is written to it."""
    fd = private_open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return os.fdopen(fd, "wb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path | str, data: bytes | str) -> None:
    """Replace `path` with `data` atomically as a 0600 file (str is written as UTF-8)."""
    atomic_write(Path(path), data.encode("utf-8") if isinstance(data, str) else data)


def private_open(path: Path, flags: int) -> int:
    """``os.open`` for a file that must be 0600: created so, or tightened if it was looser.

    Symlinks are refused (O_NOFOLLOW): nothing inside our private directories should point
    elsewhere, and following one could write a conversation to a place others can read.
    """
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte; os.write may write fewer than asked (signals, nearly full disks)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # not expected from a regular file, but never loop forever
            raise OSError(f"write returned {written}")
        view = view[written:]


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable (the entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_RE = re.compile(r"\.(?P<target>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{12}\.tmp")


def temp_name(path: Path) -> Path:
    """A fresh temp path next to ``path``: ``.<name>.<pid>.<12 hex>.tmp`` (k3chat.paths.sweep_temps removes dead ones)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def atomic_write(path: Path, data: bytes | Iterable[bytes], *, replace: bool = True) -> None:
    """Replace ``path`` with ``data`` (bytes, or chunks to avoid copying a large payload).
    With ``replace=False`` an existing ``path`` is never replaced: FileExistsError, even if
    it appeared after the caller looked (the temp file is hard-linked into place).

    Temp file in the same directory (O_EXCL, 0600) -> write -> fsync -> os.replace -> fsync
    the directory. On any failure the temp file is removed and ``path`` is unchanged.
    A directory ``path`` is refused before anything is created (its temp file would land in
    the parent, and the replace would fail anyway).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file name to write", str(path))
    tmp = temp_name(path)
    chunks: Iterable[bytes] = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    fd = private_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            for chunk in chunks:
                write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # EEXIST instead of a silent overwrite
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
