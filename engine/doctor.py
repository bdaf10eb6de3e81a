"""`k3chat doctor`: what this machine offers the engine, measured in about three seconds.

Reports the CPU (model, cores, the AVX2/FMA/AVX-512F or NEON the kernels dispatch on, and
the kernels the engine runs), RAM and the cgroup limit (Linux; sysctl and vm_stat on macOS), free disk, and the random-read bandwidth of the disk holding `--dir` with
expert-sized reads at queue depths 1, 4, 8 and 16: the access pattern of a cold MoE layer (top-k
experts requested at once, each one large read); the best depth's rate is the device's rate
`k3chat bench` holds streaming to. Ends with the budget `--memory auto` would
pick and, if `--dir` holds a model, the plan at that budget. Needs no model and no network.

The probe writes a temporary file (default 256 MiB) in `--dir`, reads random 4 KiB-aligned
chunks with O_DIRECT (F_NOCACHE on macOS; where the filesystem refuses O_DIRECT, buffered
reads followed by posix_fadvise(DONTNEED) so the page cache does not flatter the result; the
report says which), and always removes the file, including on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import darwin_info
from . import sizes as sz
from .private_files import write_private

__all__ = ["main_doctor", "cpu_info", "probe_disk", "ProbeResult", "PhaseResult"]

from .exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE  # noqa: E402 - one definition for every command

# One real K3 routed expert (spec 2.4: 3 x 3072 x 3584 x (1/2 + 1/32)); a multiple of 4096,
# so it is also a valid O_DIRECT length. The probe measures the disk for the real model, so
# it reads this size whatever model (if any) sits in --dir.
K3_EXPERT_BYTES = 17_547_264
ALIGN = 4096
DEFAULT_SIZE_MB = 256
DEFAULT_SECONDS = 0.5  # per queue depth; four phases plus writing stay near three seconds
QUEUE_DEPTHS = (1, 4, 8, 16)  # the best of these is the device's rate the bench compares with
MIN_READS = 3  # per phase, so a slow disk still gives a number from more than one read
WRITE_CHUNK = 8 * sz.MiB
FREE_MARGIN = 1 * sz.GiB  # never fill the disk to probe it


# ---------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cores: int
    usable_cores: int  # this process's affinity mask
    physical_cores: int | None
    cpu_quota: float | None  # cgroup CPU quota in cores, None when unlimited
    avx2: bool
    fma: bool
    avx512f: bool
    neon: bool  # AArch64 Advanced SIMD ("asimd" in /proc/cpuinfo, hw.optional.neon on macOS)


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            blocks.append({})
            continue
        key, _, value = line.partition(":")
        blocks[-1][key.strip()] = value.strip()
    return [b for b in blocks if b]


def _cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """cgroup CPU bandwidth limit in cores (v2 cpu.max, v1 cfs quota / period)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _usable_cores(logical: int) -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity masks
        return logical


def _darwin_cpu_info(sysctl: darwin_info.SysctlReader) -> CpuInfo:
    def flag(name: str) -> bool:
        return bool(darwin_info.sysctl_int(sysctl, name))

    logical = darwin_info.sysctl_int(sysctl, "hw.logicalcpu") or darwin_info.sysctl_int(sysctl, "hw.ncpu") \
        or os.cpu_count() or 1
    return CpuInfo(model=darwin_info.sysctl_str(sysctl, "machdep.cpu.brand_string") or "unknown",
                   logical_cores=logical, usable_cores=_usable_cores(logical),
                   physical_cores=darwin_info.sysctl_int(sysctl, "hw.physicalcpu"), cpu_quota=None,
                   avx2=flag("hw.optional.avx2_0"), fma=flag("hw.optional.fma"),
                   avx512f=flag("hw.optional.avx512f"),
                   neon=flag("hw.optional.neon") or flag("hw.optional.AdvSIMD"))


def cpu_info(cpuinfo: str | Path = "/proc/cpuinfo", *, system: str = sys.platform,
             sysctl: darwin_info.SysctlReader = darwin_info.read_sysctl) -> CpuInfo:
    """The CPU from /proc/cpuinfo and cgroups on Linux, from sysctl on macOS."""
    if system == "darwin":
        return _darwin_cpu_info(sysctl)
    try:
        blocks = _cpuinfo_blocks(Path(cpuinfo).read_text())
    except OSError:
        blocks = []
    first = blocks[0] if blocks else {}
    # x86 says "model name" and "flags"; arm64 says "Features" (and has no AVX anyway).
    model = first.get("model name") or first.get("Hardware") or first.get("CPU part") or "unknown"
    flags = set((first.get("flags") or first.get("Features") or "").split())
    cores = {(b.get("physical id", "0"), b["core id"]) for b in blocks if "core id" in b}
    logical = os.cpu_count() or 1
    return CpuInfo(model=model, logical_cores=logical, usable_cores=_usable_cores(logical),
                   physical_cores=len(cores) or None, cpu_quota=_cpu_quota(),
                   avx2="avx2" in flags, fma="fma" in flags, avx512f="avx512f" in flags,
                   neon="asimd" in flags)


# ---------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------


def filesystem_of(path: Path, mounts: str | Path = "/proc/mounts") -> str | None:
    """Filesystem type of the mount holding `path` (tmpfs, for one, refuses O_DIRECT)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, fstype = -1, None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, fstype = len(mount), parts[2]
    return fstype


@dataclass(frozen=True)
class PhaseResult:
    queue_depth: int
    reads: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ProbeResult:
    file_bytes: int
    read_bytes: int  # bytes per read (one expert, 4 KiB-aligned)
    direct_io: bool
    mode: str  # "O_DIRECT", "F_NOCACHE", "buffered + posix_fadvise(DONTNEED)" or "buffered"
    note: str  # why O_DIRECT was not used, if it was not
    write_seconds: float
    phases: tuple[PhaseResult, ...]


def _write_probe_file(fd: int, size: int) -> None:
    """Fill the file with bytes no filesystem can compress or deduplicate.

    One random block is reused with a distinct counter stamped into every 4 KiB page:
    generating fresh random bytes for the whole file would cost more than writing it.
    """
    block = np.frombuffer(random.Random(0x6B33).randbytes(WRITE_CHUNK), dtype=np.uint64).copy()
    pages = block.reshape(-1, ALIGN // 8)
    written, page_no = 0, 0
    while written < size:
        pages[:, 0] = np.arange(page_no, page_no + len(pages), dtype=np.uint64)
        page_no += len(pages)
        view = memoryview(block).cast("B")[:min(WRITE_CHUNK, size - written)]
        while view:
            view = view[os.write(fd, view):]
        written += min(WRITE_CHUNK, size - written)
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)


def _uncached_mode() -> str:
    """How this OS reads past the page cache: O_DIRECT (Linux), F_NOCACHE (macOS) or none."""
    if getattr(os, "O_DIRECT", 0):
        return "O_DIRECT"
    return "F_NOCACHE" if hasattr(fcntl, "F_NOCACHE") else "none"


def _buffered_mode() -> str:
    return "buffered + posix_fadvise(DONTNEED)" if hasattr(os, "posix_fadvise") else "buffered"


def _set_nocache(fd: int) -> None:
    """F_NOCACHE on (macOS): this descriptor's reads and writes skip the unified buffer cache."""
    fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)  # type: ignore[attr-defined]  # macOS only


def _open_for_probe(path: str) -> tuple[int, bool, str]:
    """(fd, direct?, note). O_DIRECT or F_NOCACHE where the system takes it, else buffered."""
    mode = _uncached_mode()
    if mode == "O_DIRECT":
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True, ""
        except OSError as exc:
            note = f"O_DIRECT refused at open ({exc.strerror})"
    elif mode == "F_NOCACHE":
        fd = os.open(path, os.O_RDONLY)
        try:
            _set_nocache(fd)
            return fd, True, ""
        except OSError as exc:
            os.close(fd)
            note = f"F_NOCACHE refused ({exc.strerror})"
    else:
        note = "neither O_DIRECT nor F_NOCACHE is available on this platform"
    return os.open(path, os.O_RDONLY), False, note


def _read_chunk(fd: int, buf: mmap.mmap, offset: int, direct: bool) -> int:
    got = os.preadv(fd, [buf], offset)
    if got != len(buf):
        raise OSError(f"short read: {got} of {len(buf)} bytes at offset {offset}")
    if not direct and hasattr(os, "posix_fadvise"):
        # Drop what we just read: the next random read must come from the disk too.
        os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
    return got


def _offsets(file_bytes: int, chunk: int, seed: int) -> Iterator[int]:
    """Random 4 KiB-aligned offsets with the whole chunk inside the file."""
    rng = random.Random(seed)
    last = (file_bytes - chunk) // ALIGN
    while True:
        yield rng.randint(0, last) * ALIGN


def _phase(fd: int, direct: bool, depth: int, file_bytes: int, chunk: int, seconds: float,
           stop: threading.Event) -> PhaseResult:
    """`depth` threads read random chunks until `seconds` pass (at least MIN_READS total)."""
    counts = [0] * depth
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, chunk)  # anonymous maps are page-aligned, as O_DIRECT needs
        try:
            for offset in _offsets(file_bytes, chunk, seed=1000 * depth + i):
                if stop.is_set() or errors:
                    return
                if time.perf_counter() >= deadline and sum(counts) >= MIN_READS:
                    return
                _read_chunk(fd, buf, offset, direct)
                counts[i] += 1
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            buf.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(depth)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():  # short joins keep Ctrl-C deliverable to the main thread
                t.join(0.05)
    finally:
        # On Ctrl-C, let each reader finish its read in flight before the caller closes
        # the descriptor: a closed (and maybe reused) fd must never be read from.
        stop.set()
        for t in threads:
            t.join()
        stop.clear()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    reads = sum(counts)
    return PhaseResult(depth, reads, reads * chunk, elapsed)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM during the probe unwinds like Ctrl-C, so the temp file is still removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def probe_disk(directory: Path, size_bytes: int, chunk: int = K3_EXPERT_BYTES,
               seconds: float = DEFAULT_SECONDS,
               on_path: Callable[[str], None] | None = None) -> ProbeResult:
    """Measure random-read bandwidth in `directory`; the temp file never outlives the call."""
    chunk = -(-chunk // ALIGN) * ALIGN
    size_bytes = size_bytes // ALIGN * ALIGN
    stop = threading.Event()
    fd_read = -1
    handle, path = tempfile.mkstemp(prefix=".k3chat-doctor-", suffix=".probe", dir=directory)
    if on_path is not None:
        on_path(path)
    try:
        with _sigterm_as_interrupt():
            t0 = time.perf_counter()
            try:
                if _uncached_mode() == "F_NOCACHE":  # no fadvise there: keep the file out of the cache
                    _set_nocache(handle)
                _write_probe_file(handle, size_bytes)
            finally:
                os.close(handle)
            write_seconds = time.perf_counter() - t0
            fd_read, direct, note = _open_for_probe(path)
            try:
                phases = [_phase(fd_read, direct, d, size_bytes, chunk, seconds, stop)
                          for d in QUEUE_DEPTHS]
            except OSError as exc:
                if not direct:
                    raise
                # Some filesystems accept O_DIRECT at open and refuse the read (EINVAL).
                os.close(fd_read)
                fd_read, direct = os.open(path, os.O_RDONLY), False
                note = f"O_DIRECT refused on read ({exc.strerror or exc})"
                phases = [_phase(fd_read, direct, d, size_bytes, chunk, seconds, stop)
                          for d in QUEUE_DEPTHS]
    finally:
        stop.set()
        if fd_read >= 0:
            os.close(fd_read)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    mode = _uncached_mode() if direct else _buffered_mode()
    return ProbeResult(size_bytes, chunk, direct, mode, note, write_seconds, tuple(phases))


# ---------------------------------------------------------------------------------------
# Model (optional) and the recommended budget
# ---------------------------------------------------------------------------------------


def _model_report(directory: Path, budget: int) -> dict[str, Any] | None:
    """The plan at `budget` for a model in `directory`; None when there is no model."""
    if not (directory / "config.json").exists():
        return None
    from .config import load_config
    from .errors import CheckpointError
    from .planner import PlanError, make_plan, tensor_sizes_from_dir

    try:
        cfg = load_config(directory)
        plan = make_plan(cfg, tensor_sizes_from_dir(directory, cfg), budget,
                         check_machine=False,  # `auto` is below the machine limit already
                         process_bytes=sz.process_reserve())
    except PlanError as exc:
        return {"dir": str(directory), "refused": str(exc), "minimum_budget": exc.minimum}
    except CheckpointError as exc:
        return {"dir": str(directory), "error": str(exc)}
    return {"dir": str(directory), "plan": plan.to_dict(), "table": plan.table()}


# ---------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3chat doctor",
        description="Report CPU, memory, disk and random-read bandwidth; recommend a budget.")
    ap.add_argument("--dir", default=".",
                    help="directory on the disk to probe, ideally the model directory "
                         "(default: the current directory)")
    ap.add_argument("--json", dest="json_out", help="also write the report as JSON to this file")
    ap.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB,
                    help=f"size of the temporary probe file in MiB (default {DEFAULT_SIZE_MB})")
    ap.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                    help=f"seconds of reading per queue depth (default {DEFAULT_SECONDS})")
    return ap


def _gbps(phase: PhaseResult) -> dict[str, Any]:
    out = asdict(phase)
    out["gb_per_s"] = phase.gb_per_s
    return out


def _print_report(report: dict[str, Any]) -> None:
    cpu, mem, disk = report["cpu"], report["memory"], report["disk"]
    feats = ", ".join(f"{k} {'yes' if cpu[k] else 'no'}" for k in ("avx2", "fma", "avx512f", "neon"))
    quota = f", cgroup quota {cpu['cpu_quota']:.2f} cores" if cpu["cpu_quota"] else ""
    print(f"cpu:    {cpu['model']}; {cpu['usable_cores']} usable of {cpu['logical_cores']} "
          f"logical cores ({cpu['physical_cores'] or '?'} physical){quota}; {feats}")
    engine = report["engine"]
    print(f"engine: {engine['simd']} kernels, uncached reads by {engine['direct_io']}")
    cg = mem["cgroup_limit_bytes"]
    print(f"memory: {sz.format_bytes(mem['total_bytes'])} total, "
          f"{sz.format_bytes(mem['available_bytes'])} available, swap "
          f"{sz.format_bytes(mem['swap_bytes'])}, cgroup limit "
          f"{sz.format_bytes(cg) if cg is not None else 'none'}; usable without swapping "
          f"{sz.format_bytes(mem['usable_bytes'])}")
    print(f"disk:   {disk['path']} ({disk['filesystem'] or 'unknown fs'}): "
          f"{sz.format_bytes(disk['free_bytes'])} free of {sz.format_bytes(disk['total_bytes'])}")
    probe = report["probe"]
    if probe.get("error"):
        print(f"read:   probe failed: {probe['error']}")
    else:
        print(f"read:   {probe['mode']}, {probe['read_bytes']:,} B random reads from a "
              f"{sz.format_bytes(probe['file_bytes'])} file"
              + (f" ({probe['note']})" if probe["note"] else ""))
        for ph in probe["phases"]:
            print(f"        queue depth {ph['queue_depth']}: {ph['gb_per_s']:.2f} GB/s "
                  f"({ph['reads']} reads in {ph['seconds']:.2f} s)")
        print(f"        best: queue depth {probe['best_queue_depth']}, {probe['best_gb_per_s']:.2f} GB/s")
    print(f"budget: --memory auto = {sz.format_bytes(report['recommended_budget_bytes'])} "
          f"({report['recommended_budget']})")
    model = report.get("model")
    if model:
        if "plan" in model:
            print(model["table"])
        else:
            print(model.get("refused") or model.get("error"))


def _engine_report() -> dict[str, str]:
    """The SIMD kernels the engine runs here and how its direct_io reads skip the cache."""
    from ._k3 import ffi, lib

    return {"simd": ffi.string(lib.k3_simd_kind()).decode(),
            "direct_io": ffi.string(lib.k3_direct_io_kind()).decode()}


def _budget_text(nbytes: int) -> str:
    return f"{nbytes // sz.GiB}G" if nbytes >= sz.GiB else f"{nbytes // sz.MiB}M"


def _probe_report(directory: Path, size: int, chunk: int, seconds: float) -> dict[str, Any]:
    """The probe as JSON-ready data; an I/O failure becomes an `error` entry."""
    try:
        result = probe_disk(directory, size, chunk, seconds)
    except OSError as exc:
        return {"error": f"{exc.strerror or exc} ({type(exc).__name__})"}
    probe = asdict(result)
    probe["phases"] = [_gbps(p) for p in result.phases]
    probe.update({f"qd{p.queue_depth}_gb_per_s": p.gb_per_s for p in result.phases})
    top = max(result.phases, key=lambda p: p.gb_per_s)
    probe["best_queue_depth"], probe["best_gb_per_s"] = top.queue_depth, top.gb_per_s
    probe["error"] = None
    return probe


def main_doctor(argv: Sequence[str]) -> int:
    """`k3chat doctor [--dir PATH] [--json OUT] [--size-mb N]`: 0 ok, 1 probe failed, 2 usage,
    5 interrupted."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"k3chat doctor: {directory} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    if args.seconds <= 0:
        print("k3chat doctor: --seconds must be positive", file=sys.stderr)
        return EXIT_USAGE

    machine = sz.read_machine_memory()
    budget = sz.auto_budget(machine)
    model = _model_report(directory, budget)
    chunk = K3_EXPERT_BYTES
    size = args.size_mb * sz.MiB
    if size < 2 * chunk:
        print(f"k3chat doctor: --size-mb {args.size_mb} is too small for {chunk:,} B reads; "
              f"use at least {-(-2 * chunk // sz.MiB)}", file=sys.stderr)
        return EXIT_USAGE
    usage = shutil.disk_usage(directory)
    cpu = cpu_info()
    report: dict[str, Any] = {
        "cpu": asdict(cpu),
        "engine": _engine_report(),
        "memory": {"total_bytes": machine.total, "available_bytes": machine.available,
                   "swap_bytes": machine.swap_total,
                   "cgroup_limit_bytes": machine.cgroup.limit if machine.cgroup else None,
                   "cgroup_version": machine.cgroup.version if machine.cgroup else None,
                   "usable_bytes": machine.limit},
        "disk": {"path": str(directory.resolve()), "free_bytes": usage.free,
                 "total_bytes": usage.total, "filesystem": filesystem_of(directory)},
        "recommended_budget_bytes": budget,
        "recommended_budget": _budget_text(budget),
        "model": model,
    }
    if usage.free < size + FREE_MARGIN:
        report["probe"] = {"error": f"only {sz.format_bytes(usage.free)} free; the probe "
                                    f"needs {sz.format_bytes(size)} plus a "
                                    f"{sz.format_bytes(FREE_MARGIN)} margin"}
    else:
        try:
            report["probe"] = _probe_report(directory, size, chunk, args.seconds)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: probe_disk has removed its file
            print("k3chat doctor: interrupted; the probe file was removed", file=sys.stderr)
            return EXIT_INTERRUPTED
    status = EXIT_RUNTIME if report["probe"].get("error") else EXIT_OK
    _print_report(report)
    if args.json_out:
        write_private(args.json_out, json.dumps(report, indent=2) + "\n")  # 0600 like run --json
    return status


if __name__ == "__main__":
    raise SystemExit(main_doctor(sys.argv[1:]))
