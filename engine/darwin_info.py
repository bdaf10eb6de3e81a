"""macOS machine facts: sysctl values (hw.memsize, hw.ncpu, ...) and `vm_stat`'s page counts.

macOS has no /proc and no cgroups; memory and cores come from sysctlbyname(3) (through
ctypes, no subprocess) and the memory the system can hand out without swapping from
`vm_stat` (free + speculative + inactive pages, what macOS reclaims first). The readers are
parameters everywhere they are used, so the parsing is tested on any OS with recorded output.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from collections.abc import Callable

__all__ = ["SysctlReader", "read_sysctl", "sysctl_int", "sysctl_str", "parse_vm_stat",
           "run_vm_stat", "available_bytes"]

# name -> raw value bytes, or None when this system has no such sysctl
SysctlReader = Callable[[str], bytes | None]

_PAGE_SIZE_RE = re.compile(r"page size of (\d+) bytes")
_COUNT_RE = re.compile(r'^"?([A-Za-z][^:"]*)"?:\s+(\d+)\.?\s*$')


def read_sysctl(name: str) -> bytes | None:
    """sysctlbyname(name) as raw bytes; None where the call or the name does not exist."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sysctlbyname
    except (OSError, AttributeError):  # glibc has no sysctlbyname
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_void_p, ctypes.c_size_t]
    size = ctypes.c_size_t(0)
    if fn(name.encode(), None, ctypes.byref(size), None, 0) != 0 or size.value == 0:
        return None
    buf = ctypes.create_string_buffer(size.value)
    if fn(name.encode(), buf, ctypes.byref(size), None, 0) != 0:
        return None
    return buf.raw[:size.value]


def sysctl_int(read: SysctlReader, name: str) -> int | None:
    """An integer sysctl (4 or 8 bytes, little-endian on every Mac macOS runs on)."""
    raw = read(name)
    if raw is None or len(raw) not in (4, 8):
        return None
    return int.from_bytes(raw, "little", signed=False)


def sysctl_str(read: SysctlReader, name: str) -> str | None:
    raw = read(name)
    if raw is None:
        return None
    text = raw.split(b"\0", 1)[0].decode("utf-8", errors="replace").strip()
    return text or None


def parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """(page size, {"free": pages, "inactive": ...}) from `vm_stat`'s output.

    Lines read `Pages free:    12345.`; the header says `(page size of 16384 bytes)`."""
    size = _PAGE_SIZE_RE.search(text)
    if size is None:
        raise ValueError("vm_stat output without its 'page size of N bytes' header")
    counts: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        m = _COUNT_RE.match(line.strip())
        if m:
            name = m.group(1).strip().lower()
            counts[name[len("pages "):] if name.startswith("pages ") else name] = int(m.group(2))
    return int(size.group(1)), counts


def run_vm_stat() -> str | None:
    """`vm_stat`'s output, or None where it is missing or fails."""
    try:
        done = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def available_bytes(vm_stat: str) -> int:
    """What can be allocated without swapping: free, speculative and inactive pages (macOS
    takes inactive pages back before it swaps; wired, active and compressed stay)."""
    page, counts = parse_vm_stat(vm_stat)
    missing = [k for k in ("free", "inactive") if k not in counts]
    if missing:
        raise ValueError(f"vm_stat output without the {' and '.join(missing)} page count")
    return page * (counts["free"] + counts.get("speculative", 0) + counts["inactive"])
