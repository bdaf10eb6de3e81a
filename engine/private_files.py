"""Private directories and files for everything k3chat writes (checkpoints, reports, JSON).

Every directory we create is 0700 and every file we write 0600, whatever the umask: the
XDG base directory rule for the directories, and one rule for all outputs so that nobody
has to decide per file whether it may hold something private (a `--json` report names the
model and the machine; a history holds conversations). Directories that already exist are
left as they are: they belong to the user (a shared ~/.cache, a mount point).

Only the standard library, so both `k3engine` and `k3chat` can use it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO

__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "make_private_dirs", "open_private",
           "write_private"]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        return os.fdopen(fd, "wb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path | str, data: bytes | str) -> None:
    """Replace `path` with `data` atomically as a 0600 file (str is written as UTF-8).

    A temp file beside it is written, fsynced and renamed over `path`: a crash leaves the old
    file or the new one, and the new one is never visible with a looser mode."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        with open_private(tmp) as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
