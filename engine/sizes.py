"""Memory sizes: parsing the `--memory` budget and reading what the machine can hold.

Budget strings (case-insensitive, spaces around the unit allowed):

| form | meaning |
|---|---|
| `12G`, `512M`, `1.5T`, `64K` | binary: 1 K = 1024 B (as `free`, systemd and Docker count RAM) |
| `12GiB`, `12Gi`, `512MiB` | binary, spelled out |
| `12GB`, `512MB`, `1.5TB` | decimal (SI): 1 GB = 10^9 B |
| `123456789`, `123456789B` | bytes (an integer) |
| `small`, `medium`, `large`, `huge` | presets: 8 GiB, 16 GiB, 64 GiB, 256 GiB |
| `auto` | `AUTO_FRACTION` of what this machine can hold without swapping |

What the machine can hold is the smaller of `MemAvailable` (swap never counts: a plan that
relies on swap would make every expert read a page fault) and the headroom left under the
process's cgroup memory limit (v2 `memory.max`, or v1 `memory.limit_in_bytes`), taking the
tightest limit of the cgroup and its ancestors. On macOS (no /proc, no cgroups) the total is
sysctl `hw.memsize` and the available memory `vm_stat`'s free + speculative + inactive pages
(engine/darwin_info.py).
"""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from . import darwin_info

__all__ = [
    "KiB", "MiB", "GiB", "TiB", "PRESETS", "AUTO_FRACTION",
    "MemorySizeError", "MachineMemory", "CgroupMemory",
    "parse_memory", "parse_size", "is_auto", "auto_budget", "format_bytes", "gib",
    "read_meminfo", "read_cgroup_memory", "read_machine_memory",
    "PROCESS_GROWTH", "resident_bytes", "peak_resident_bytes", "process_reserve",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# Named budgets. The split each gives for the real K3 is in engine/planner.py's docstring.
PRESETS: dict[str, int] = {
    "small": 8 * GiB,
    "medium": 16 * GiB,
    "large": 64 * GiB,
    "huge": 256 * GiB,
}

# `auto` leaves 15 % of the available memory to the rest of the process (Python, the
# tokenizer, the Textual app) and to the kernel's own needs, so that "auto" never lands the
# machine at the edge of reclaim. Rounded down to whole 256 MiB steps so the number is
# readable and stable from one run to the next.
AUTO_FRACTION = Fraction(85, 100)
AUTO_STEP = 256 * MiB

# cgroup v1 reports "no limit" as a huge page-aligned number (2^63 rounded down to a page).
_V1_UNLIMITED = 1 << 60

_UNITS: dict[str, int] = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}  # powers of the base
_SIZE_RE = re.compile(r"^(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[kmgtp]?)(?P<i>i?)(?P<b>b?)$")
_FORMS = ("a size such as 12G, 512M, 1.5T, 12GiB (binary) or 12GB (decimal), a byte count, "
          f"a preset ({', '.join(f'{k}={v // GiB}G' for k, v in PRESETS.items())}) or auto")


class MemorySizeError(ValueError):
    """A budget string could not be read; the message says what is accepted."""


# ---------------------------------------------------------------------------------------
# Parsing and formatting
# ---------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes for a size string (no presets, no auto). Raises MemorySizeError."""
    raw = text.strip().lower()
    m = _SIZE_RE.match(raw)
    if not m:
        raise MemorySizeError(f"cannot read memory size {text!r}: expected {_FORMS}")
    unit, binary_i, b = m["unit"], m["i"], m["b"]
    if binary_i and not unit:
        raise MemorySizeError(f"cannot read memory size {text!r}: 'i' needs a unit letter "
                              f"before it (KiB, MiB, GiB, TiB)")
    # G / Gi / GiB are binary; GB is decimal; a bare number or "B" is bytes.
    decimal = bool(unit) and bool(b) and not binary_i
    base = 1000 if decimal else 1024
    value = Fraction(m["num"]) * base ** _UNITS[unit]
    if not unit and value.denominator != 1:
        raise MemorySizeError(f"cannot read memory size {text!r}: a byte count must be a "
                              f"whole number")
    nbytes = int(value)  # fractions of a byte round down: a budget is a ceiling
    if nbytes <= 0:
        raise MemorySizeError(f"memory size {text!r} must be more than 0 bytes")
    return nbytes


def is_auto(text: str) -> bool:
    return text.strip().lower() == "auto"


def parse_memory(text: str, machine: "MachineMemory | None" = None) -> int:
    """Bytes for a `--memory` value: a size, a preset name or `auto`.

    `auto` reads the machine (or uses `machine` when given, which tests pass).
    """
    key = text.strip().lower()
    if not key:
        raise MemorySizeError(f"empty memory size: expected {_FORMS}")
    if key in PRESETS:
        return PRESETS[key]
    if key == "auto":
        return auto_budget(machine if machine is not None else read_machine_memory())
    if key[0].isalpha():
        raise MemorySizeError(f"unknown memory preset {text!r}: expected {_FORMS}")
    return parse_size(text)


def auto_budget(machine: "MachineMemory") -> int:
    """The budget `auto` picks: AUTO_FRACTION of the machine's limit, in 256 MiB steps."""
    usable = int(machine.limit * AUTO_FRACTION)
    return usable - usable % AUTO_STEP if usable >= AUTO_STEP else usable


def gib(nbytes: int) -> str:
    return f"{nbytes / GiB:,.2f} GiB"


def format_bytes(nbytes: int) -> str:
    """Human size in binary units (the unit `--memory 12G` uses)."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:,.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------
# Machine memory
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit over the process's cgroup and its ancestors."""

    version: int  # 1 or 2
    path: str  # the cgroup directory whose limit is tightest
    limit: int
    usage: int  # charged to that cgroup now
    reclaimable: int  # of `usage`: page cache the kernel can drop (inactive file pages)

    @property
    def headroom(self) -> int:
        # Page cache is charged to the cgroup but does not stop us allocating: count it free.
        return max(0, self.limit - (self.usage - self.reclaimable))


@dataclass(frozen=True)
class MachineMemory:
    total: int  # MemTotal
    available: int  # MemAvailable (what can be allocated without swapping)
    swap_total: int
    cgroup: CgroupMemory | None

    @property
    def limit(self) -> int:
        """What a plan may use without swapping or hitting the cgroup limit."""
        if self.cgroup is None:
            return self.available
        return min(self.available, self.cgroup.headroom)

    def describe(self) -> str:
        text = f"MemAvailable {format_bytes(self.available)} of {format_bytes(self.total)}"
        if self.cgroup is not None:
            cg = self.cgroup
            text += (f"; cgroup v{cg.version} limit {format_bytes(cg.limit)} "
                     f"({format_bytes(cg.headroom)} free under it)")
        else:
            text += "; no cgroup memory limit"
        return text


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes (the file says kB, meaning KiB)."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = KiB if len(fields) > 1 and fields[1].lower() == "kb" else 1
        out[name.strip()] = int(fields[0]) * scale
    return out


def _read_int(path: Path) -> int | None:
    """An integer file of the cgroup fs; None when absent, unreadable or 'max'."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process, from /proc/self/cgroup."""
    v2: str | None = None
    v1: str | None = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and parts[0] == "0":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _candidates(mount: Path, own: str | None) -> list[Path]:
    """The cgroup directory and its ancestors up to the mount, deepest first.

    Inside a container the path in /proc/self/cgroup may name a host directory that is not
    visible (the namespace root is mounted instead), so the mount root always ends the list.
    """
    dirs: list[Path] = []
    if own:
        rel = Path(own.lstrip("/"))
        for part in (rel, *rel.parents):
            d = mount / part
            if d.is_dir() and d not in dirs:
                dirs.append(d)
    if mount not in dirs and mount.is_dir():
        dirs.append(mount)
    return dirs


def _tightest_v2(mount: Path, own: str | None) -> CgroupMemory | None:
    best: CgroupMemory | None = None
    for d in _candidates(mount, own):
        limit = _read_int(d / "memory.max")  # "max" reads as None: no limit here
        if limit is None:
            continue
        usage = _read_int(d / "memory.current") or 0
        reclaimable = _read_stat(d / "memory.stat").get("inactive_file", 0)
        cg = CgroupMemory(2, str(d), limit, usage, min(reclaimable, usage))
        if best is None or cg.headroom < best.headroom:
            best = cg
    return best


def _tightest_v1(mount: Path, own: str | None) -> CgroupMemory | None:
    best: CgroupMemory | None = None
    for d in _candidates(mount, own):
        limit = _read_int(d / "memory.limit_in_bytes")
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _read_int(d / "memory.usage_in_bytes") or 0
        stat = _read_stat(d / "memory.stat")
        reclaimable = stat.get("total_inactive_file", stat.get("inactive_file", 0))
        cg = CgroupMemory(1, str(d), limit, usage, min(reclaimable, usage))
        if best is None or cg.headroom < best.headroom:
            best = cg
    return best


def read_cgroup_memory(root: str | Path = "/sys/fs/cgroup",
                       proc_cgroup: str | Path = "/proc/self/cgroup") -> CgroupMemory | None:
    """The tightest cgroup memory limit that applies to this process, or None if unlimited."""
    root, proc = Path(root), Path(proc_cgroup)
    v2_path, v1_path = _own_cgroups(proc)
    found: list[CgroupMemory] = []
    # Unified hierarchy at the root (pure v2) or under "unified" (hybrid systems).
    for mount in (root, root / "unified"):
        if (mount / "cgroup.controllers").exists():
            cg = _tightest_v2(mount, v2_path)
            if cg is not None:
                found.append(cg)
    if (root / "memory").is_dir():
        cg = _tightest_v1(root / "memory", v1_path)
        if cg is not None:
            found.append(cg)
    return min(found, key=lambda c: c.headroom) if found else None


def read_machine_memory(meminfo: str | Path = "/proc/meminfo",
                        cgroup_root: str | Path = "/sys/fs/cgroup",
                        proc_cgroup: str | Path = "/proc/self/cgroup", *,
                        system: str = sys.platform,
                        sysctl: darwin_info.SysctlReader = darwin_info.read_sysctl,
                        vm_stat: Callable[[], str | None] = darwin_info.run_vm_stat) -> MachineMemory:
    """RAM and limits of this machine: /proc and cgroups on Linux, sysctl and vm_stat on
    macOS; elsewhere sysconf's total."""
    if system == "darwin":
        return _darwin_memory(sysctl, vm_stat)
    try:
        info = read_meminfo(meminfo)
    except OSError:
        info = {}
    total = info.get("MemTotal") or _sysconf_total()
    # Kernels before 3.14 lack MemAvailable; free + page cache is the old estimate.
    available = info.get("MemAvailable")
    if available is None:
        available = info.get("MemFree", 0) + info.get("Cached", 0) or total
    return MachineMemory(total=total, available=available, swap_total=info.get("SwapTotal", 0),
                         cgroup=read_cgroup_memory(cgroup_root, proc_cgroup))


def _darwin_memory(sysctl: darwin_info.SysctlReader,
                   vm_stat: Callable[[], str | None]) -> MachineMemory:
    total = darwin_info.sysctl_int(sysctl, "hw.memsize") or _sysconf_total()
    text = vm_stat()
    try:
        available = darwin_info.available_bytes(text) if text is not None else None
    except ValueError:
        available = None
    if available is None:
        # Without vm_stat only the free pages are known: an underestimate, never more than
        # the machine can give.
        free = darwin_info.sysctl_int(sysctl, "vm.page_free_count") or 0
        available = free * (darwin_info.sysctl_int(sysctl, "hw.pagesize") or 4096)
    # vm.swapusage is a struct xsw_usage whose first field is the swap total in bytes
    swap = sysctl("vm.swapusage")
    swap_total = int.from_bytes(swap[:8], "little") if swap is not None and len(swap) >= 8 else 0
    return MachineMemory(total=total, available=min(available, total) if total else available,
                         swap_total=swap_total, cgroup=None)


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# What a front-end process grows by after the model is opened, beside the engine's own
# memory: the tokenizer, the turn's Python objects, the app's widgets and rendering.
# Measured as VmHWM at exit minus VmRSS when open_budgeted was called, with --memory all,
# so the engine's own weights are inside the numbers (Python 3.11, Textual 0.x, Linux):
# `k3chat run --ids` on the tiny fixture 4.5 MiB, `run --prompt` 10.3 MiB (engine ~4 MiB of
# it), `run --demo --prompt` 13.3 MiB (7.5 MiB of weights), the app answering three turns on
# the demo model in a headless run_test 19.8 MiB. VmRSS at that call was 36-40 MiB for run
# and 57 MiB for the app (its widgets are mounted by then). 32 MiB covers the largest growth
# with a margin of more than half; the transcript of a very long chat grows beyond it.
PROCESS_GROWTH = 32 * MiB


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maxrss_bytes(system: str = sys.platform) -> int:
    # ru_maxrss is in KiB on Linux and the BSDs, in bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if system == "darwin" else 1024)


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), or its peak where /proc is missing."""
    now = _status_bytes("VmRSS:")
    return now if now is not None else _maxrss_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident memory (VmHWM).

    Not getrusage's ru_maxrss: Linux keeps that across execve, so a `k3chat` started by a
    large process (a test runner, an IDE) would report its parent's size as its own peak."""
    peak = _status_bytes("VmHWM:")
    return peak if peak is not None else _maxrss_bytes()


def process_reserve() -> int:
    """What the process needs beside the engine, measured now: its resident memory (the
    interpreter, numpy, cffi, the front-end's imports, the app's widgets when it runs)
    plus PROCESS_GROWTH for what it allocates after the model is open."""
    return resident_bytes() + PROCESS_GROWTH
