"""Where k3chat keeps its files, and how it writes them privately.

Users keep privileged conversations here (clients, patients), so every directory we own is
0700 and every file 0600, whatever the umask, and every replacement of a file is atomic:
a crash leaves either the old file or the new one, never a mix.

``K3CHAT_HOME`` replaces the platform directories with ``$K3CHAT_HOME/{data,config,state}``
(and ``cache/`` for the benchmark checkpoint);
tests use it so they never touch the real home. POSIX only (the store relies on fcntl).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

# One private writer for the whole project, in k3engine (which cannot import k3chat);
# re-exported here because the chat side names them paths.X.
from k3engine.private_files import (  # noqa: F401
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    TEMP_RE,
    UnsafePathError,
    atomic_write,
    fsync_dir,
    make_private_dirs,
    private_open,
    temp_name,
    write_all,
)

APP_NAME = "k3chat"
HOME_ENV = "K3CHAT_HOME"
CONFIG_FILENAME = "config.toml"


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
        m = TEMP_RE.fullmatch(entry.name)
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
