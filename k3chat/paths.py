"""Where k3chat keeps its files, and how it writes them privately.

Users keep privileged conversations here (clients, patients), so every directory we own is
0700 and every file 0600, whatever the umask, and every replacement of a file is atomic:
a crash leaves either the old file or the new one, never a mix.

``K3CHAT_HOME`` replaces the platform directories with ``$K3CHAT_HOME/{data,config,state}``
(and ``cache/`` for the benchmark checkpoint);
tests use it so they never touch the real home. POSIX only (the store relies on fcntl).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

import platformdirs
from k3engine.private_files import make_private_dirs

APP_NAME = "k3chat"
HOME_ENV = "K3CHAT_HOME"
CONFIG_FILENAME = "config.toml"

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UnsafePathError(OSError):
    """A path we must keep private is not ours or cannot be made private."""


def _home_override() -> Path | None:
    value = os.environ.get(HOME_ENV)
    # An empty variable is treated as unset: an accidental `K3CHAT_HOME=` must not put the
    # user's history in the current directory.
    if not value:
        return None
    return Path(value).expanduser()


def data_dir() -> Path:
    """Directory for history (not created here)."""
    home = _home_override()
    if home is not None:
        return home / "data"
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def config_dir() -> Path:
    """Directory for config.toml (not created here)."""
    home = _home_override()
    if home is not None:
        return home / "config"
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def state_dir() -> Path:
    """Directory for engine state files (not created here)."""
    home = _home_override()
    if home is not None:
        return home / "state"
    return Path(platformdirs.user_state_dir(APP_NAME, appauthor=False))


def config_file() -> Path:
    return config_dir() / CONFIG_FILENAME


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) and make sure it is a 0700 directory we own.

    A looser existing directory is tightened rather than refused, because earlier versions or
    a user's ``mkdir`` may have created it with the umask; one owned by someone else is
    refused, since chmod would not make it private from its owner.
    """
    path = Path(path)
    if not path.exists():
        # Missing parents are ours too (K3CHAT_HOME itself, or ~/.local/share on a fresh
        # account): 0700 as the XDG rule asks. Existing ones are left as the user has them.
        make_private_dirs(path.parent)
        try:
            os.mkdir(path, PRIVATE_DIR_MODE)
        except FileExistsError:
            pass  # another process won the race; checked below like any existing directory
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user; refusing to use it")
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE:
        # The umask can only remove bits from mkdir's mode, so this also repairs e.g. 0500.
        try:
            os.chmod(path, PRIVATE_DIR_MODE)
        except OSError as exc:
            raise UnsafePathError(f"cannot make {path} private (mode 0700): {exc.strerror}") from exc
    return path


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


_TEMP_RE = re.compile(r"\.(?P<target>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{12}\.tmp")


def temp_name(path: Path) -> Path:
    """A fresh temp path next to ``path``: ``.<name>.<pid>.<12 hex>.tmp`` (see sweep_temps)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    except OverflowError:
        return False
    return True


def sweep_temps(directory: Path, *, target: str | None = None, any_pid: bool = False) -> list[Path]:
    """Remove atomic_write temp files in ``directory`` left by processes that died mid-write
    (a crash, a kill -9, a power cut): they hold the same private text as the file they were
    to replace, and nothing else would ever remove them.

    ``target`` limits the sweep to temp files for that file name; ``any_pid`` removes them
    even if their writer still runs (used when that file is being deleted, so no copy of it
    survives). Best effort: a missing directory or a file that vanished meanwhile is fine.
    Returns the paths removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = _TEMP_RE.fullmatch(entry.name)
        if m is None or (target is not None and m["target"] != target):
            continue
        if entry.is_dir(follow_symlinks=False):
            continue
        if not any_pid and _pid_alive(int(m["pid"])):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to remove (e.g. a read-only mount): left for the next sweep
        removed.append(Path(entry.path))
    return removed


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
