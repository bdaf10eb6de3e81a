"""cffi build module (API mode) for the native engine.

setup.py names `engine/_build.py:ffibuilder`; the extension is `k3engine._k3`.
The cdef is taken from native/k3.h itself so the header stays the one contract.

Compiler flags depend on the operating system only, never on the CPU: no -mavx2 or -march
anywhere, so one build runs on every CPU of its architecture.  On x86-64 the AVX2 kernels
carry their own target attribute and are chosen at run time (__builtin_cpu_supports); on
AArch64 the NEON kernels need no flag (Advanced SIMD is part of the architecture).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"


def _cdef_from_header(text: str) -> str:
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            if re.match(r"#define\s+\w+\s+-?\d+\s*$", s):
                out.append(s)
            continue
        out.append(line)
    return "\n".join(out)


def _sources() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in NATIVE.glob("*.c"))


# -ffp-contract=off matters most on AArch64 and Apple clang, whose compilers fuse a*b+c by
# default: the fixed reduction order (k3_kernels.c) needs every add rounded on its own.
_COMMON = ["-std=c99", "-O2", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wno-unused-function"]
# What -std=c99 hides and the engine uses: glibc hides pread, posix_memalign and O_DIRECT
# without _GNU_SOURCE; macOS shows F_NOCACHE only with _DARWIN_C_SOURCE when any POSIX level
# is requested.
_OS_FLAGS = {"linux": ["-D_GNU_SOURCE"], "darwin": ["-D_DARWIN_C_SOURCE"]}


def compile_flags(system: str = sys.platform, debug: bool = False) -> list[str]:
    """The C flags for `system` (a sys.platform value): the same on every architecture and
    CPU model of it (no ISA flags, see the module docstring)."""
    flags = _COMMON + _OS_FLAGS.get("linux" if system.startswith("linux") else system, [])
    if debug:
        flags = [f for f in flags if f != "-O2"] + ["-O0", "-g", "-fsanitize=address,undefined"]
    return flags


_cflags = compile_flags(debug=bool(os.environ.get("K3_DEBUG_BUILD")))

ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header((NATIVE / "k3.h").read_text()))
ffibuilder.set_source(
    "k3engine._k3",
    '#include "k3.h"\n',
    sources=_sources(),
    include_dirs=[str(NATIVE.relative_to(ROOT))],
    extra_compile_args=_cflags,
    extra_link_args=["-lpthread", "-lm"] + (["-fsanitize=address,undefined"] if os.environ.get("K3_DEBUG_BUILD") else []),
)

if __name__ == "__main__":
    os.chdir(ROOT)
    ffibuilder.compile(verbose=True)
    sys.exit(0)
