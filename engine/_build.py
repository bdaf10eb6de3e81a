"""cffi build module (API mode) for the native engine.

setup.py names `engine/_build.py:ffibuilder`; the extension is `k3engine._k3`.
The cdef is taken from native/k3.h itself so the header stays the one contract.
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


_cflags = ["-std=c99", "-O2", "-ffp-contract=off", "-fno-fast-math", "-D_GNU_SOURCE",
           "-Wall", "-Wno-unused-function"]
if os.environ.get("K3_DEBUG_BUILD"):
    _cflags = [f for f in _cflags if f != "-O2"] + ["-O0", "-g", "-fsanitize=address,undefined"]

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
