"""AArch64 bit identity under qemu user mode: tests/aarch64/run.sh builds the engine with
the aarch64 cross compiler and checks every NEON kernel and the tiny fixture's forward pass
against the scalar path there and against x86-64's bits here.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user; skipped, with the reason, without them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "aarch64" / "run.sh"
TOOLS = ("aarch64-linux-gnu-gcc", "qemu-aarch64", "cc")


def test_neon_kernels_and_forward_bit_identical_under_qemu(tmp_path: Path) -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install -y gcc-aarch64-linux-gnu "
                    "qemu-user): the AArch64 NEON bit-identity run cannot happen here")
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    done = subprocess.run(["sh", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "kernels: simd neon" in out and "forward: simd neon" in out
    assert out.count(" 0 mismatches") == 4  # kernels and forward, each architecture
    assert "kernel results identical on x86-64 and aarch64" in out
    assert "forward logits identical" in out
    assert "MISMATCH" not in out
