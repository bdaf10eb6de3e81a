#!/bin/sh
# tests/aarch64/run.sh: the engine's AArch64 (NEON) bit-identity tests under qemu user mode.
#
# Builds tests/aarch64/bits.c with the whole engine (native/*.c, with the flags
# engine/_build.py gives Linux) twice: natively for x86-64 and with aarch64-linux-gnu-gcc
# (static), which runs under qemu-aarch64.  Each build checks every kernel and the tiny
# fixture's forward pass, scalar against SIMD (AVX2 here, NEON there), and writes its
# results; the two architectures' results must then be the same bytes, and the x86 forward
# the same bytes as k3engine's through cffi.
#
# Needs: Debian's gcc-aarch64-linux-gnu and qemu-user (apt-get install -y
# gcc-aarch64-linux-gnu qemu-user), a C compiler, and a Python with k3engine installed
# (PYTHON, default: the checkout's .venv).  Exit 0 only when every comparison holds.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CC=${CC:-cc}
CROSS=${CROSS_CC:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-qemu-aarch64}

for tool in "$CC" "$CROSS" "$QEMU" "$PYTHON"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "run.sh: $tool not found (apt-get install -y gcc-aarch64-linux-gnu qemu-user; PYTHON=python with k3engine)" >&2
        exit 2
    fi
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/k3-aarch64.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM

# The flags pip uses on Linux, from engine/_build.py itself (the same for x86-64 and AArch64).
CFLAGS=$(cd "$ROOT" && "$PYTHON" -c '
import importlib.util
spec = importlib.util.spec_from_file_location("k3build", "engine/_build.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(" ".join(mod.compile_flags("linux")))')
echo "run.sh: CFLAGS $CFLAGS"

start=$(date +%s)
cd "$ROOT"
# both builds at once: they are independent and the machine may have two cores
$CC $CFLAGS -Inative native/*.c tests/aarch64/bits.c -o "$WORK/bits-x86_64" -lpthread -lm &
x86=$!
$CROSS $CFLAGS -static -Inative native/*.c tests/aarch64/bits.c -o "$WORK/bits-aarch64" -lpthread -lm &
arm=$!
"$PYTHON" tests/aarch64/open_spec.py "$WORK/tiny" "$WORK/spec.txt" "$WORK/forward-cffi.bin"
wait $x86
wait $arm
echo "run.sh: built in $(( $(date +%s) - start )) s"

"$WORK/bits-x86_64" kernels "$WORK/kernels-x86_64.bin"
"$QEMU" "$WORK/bits-aarch64" kernels "$WORK/kernels-aarch64.bin" --expect-simd neon
cmp "$WORK/kernels-x86_64.bin" "$WORK/kernels-aarch64.bin"
echo "run.sh: kernel results identical on x86-64 and aarch64 ($(wc -c <"$WORK/kernels-x86_64.bin") bytes)"

"$WORK/bits-x86_64" forward "$WORK/spec.txt" "$WORK/forward-x86_64.bin"
cmp "$WORK/forward-cffi.bin" "$WORK/forward-x86_64.bin"
"$QEMU" "$WORK/bits-aarch64" forward "$WORK/spec.txt" "$WORK/forward-aarch64.bin" --expect-simd neon
cmp "$WORK/forward-x86_64.bin" "$WORK/forward-aarch64.bin"
echo "run.sh: forward logits identical: k3engine (cffi, x86-64), driver x86-64, driver aarch64 ($(wc -c <"$WORK/forward-x86_64.bin") bytes)"
echo "run.sh: all aarch64 bit-identity checks passed in $(( $(date +%s) - start )) s"
