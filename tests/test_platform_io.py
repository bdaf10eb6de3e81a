"""The platform layer (native/k3_platform.c): Linux-only calls live only there, the macOS
and other-POSIX branches are valid C, the engine names its SIMD kernels and its uncached-read
mechanism, and the direct-I/O statistics still say what happened."""
from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3engine._k3 import ffi, lib
from k3engine.model import Model, StreamOptions

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
SHIM = ROOT / "tests" / "aarch64" / "macos_shim.h"
LINUX_ONLY = re.compile(r"\b(O_DIRECT|posix_fadvise|POSIX_FADV_\w+|F_NOCACHE|sched_\w+|sysctl\w*)\b")


def _code(path: Path) -> str:
    """C source without comments or string literals (names in prose do not count)."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_no_linux_only_call_outside_the_platform_layer() -> None:
    users = {p.name: sorted(set(LINUX_ONLY.findall(_code(p))))
             for p in sorted(NATIVE.glob("*.[ch]")) if LINUX_ONLY.search(_code(p))}
    assert users == {"k3_platform.c": ["F_NOCACHE", "O_DIRECT", "POSIX_FADV_DONTNEED", "posix_fadvise"]}


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on PATH: the macOS branch cannot be compile-checked here")
    return cc


@pytest.mark.parametrize("target", [["-D__APPLE__"], []], ids=["macos", "other-posix"])
def test_non_linux_branches_are_valid_c(target: list[str]) -> None:
    # Every engine file with __linux__ undefined: the shim poisons posix_fadvise and leaves
    # O_DIRECT undeclared, so any use outside the Linux branch fails to compile.
    cc = _compiler()
    for src in sorted(NATIVE.glob("*.c")):
        cmd = [cc, "-fsyntax-only", "-std=c99", "-Wall", "-Werror", "-Wno-unused-function",
               "-U__linux__", "-U__gnu_linux__", "-Ulinux", "-U__linux", *target,
               "-include", str(SHIM), f"-I{NATIVE}", str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{src.name}:\n{done.stderr}"


def test_engine_names_its_io_and_simd() -> None:
    io = ffi.string(lib.k3_direct_io_kind()).decode()
    simd = ffi.string(lib.k3_simd_kind()).decode()
    expected_io = {"linux": "O_DIRECT", "darwin": "F_NOCACHE"}.get(
        "linux" if sys.platform.startswith("linux") else sys.platform, "none")
    assert io == expected_io
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        assert simd == ("avx2" if lib.k3_cpu_has_avx2() else "none")
    elif machine in ("aarch64", "arm64"):
        assert simd == "neon" and not lib.k3_cpu_has_avx2()
    else:
        assert simd == "none"


def _fs_type(path: Path) -> str | None:
    from k3engine.doctor import filesystem_of
    return filesystem_of(path)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_io_statistics(tiny_dir: Path, direct: bool) -> None:
    with Model(tiny_dir, streaming=StreamOptions(expert_cache_bytes=9 * 16384, direct_io=direct)) as m:
        st = m.stats()
    if not direct:
        assert (st["direct_io"], st["direct_io_refused"]) == (0, 0)
        return
    # asked for: either in use or refused, and said which
    assert st["direct_io"] + st["direct_io_refused"] == 1
    fs = _fs_type(tiny_dir)
    if sys.platform.startswith("linux") and fs in ("ext4", "xfs", "btrfs"):
        assert st["direct_io"] == 1, f"{fs} takes O_DIRECT"
    elif sys.platform.startswith("linux") and fs == "tmpfs":
        assert st["direct_io_refused"] == 1


def _build_module():
    spec = importlib.util.spec_from_file_location("k3_build_under_test", ROOT / "engine" / "_build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compile_flags_per_os_without_isa_flags() -> None:
    build = _build_module()
    for system in ("linux", "darwin", "freebsd14"):
        flags = build.compile_flags(system)
        # one build for every CPU of the architecture; SIMD is chosen at run time
        assert not [f for f in flags if f.startswith(("-m", "-march", "-mcpu", "-mtune"))], flags
        assert "-ffp-contract=off" in flags and "-std=c99" in flags
        assert not [f for f in flags if "fast-math" in f and f != "-fno-fast-math"]
    assert "-D_GNU_SOURCE" in build.compile_flags("linux")
    assert "-D_DARWIN_C_SOURCE" in build.compile_flags("darwin")
    assert "-D_GNU_SOURCE" not in build.compile_flags("darwin")
    debug = build.compile_flags("linux", debug=True)
    assert "-O0" in debug and "-O2" not in debug
