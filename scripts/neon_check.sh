#!/usr/bin/env bash
# NEON in CI without Arm hardware: cross-compile the native sources for AArch64, then run
# tests/native/selftest.c under qemu-aarch64. The self-test checks the NEON kernel against the
# scalar one bit for bit (every precision, dtype, rounding, tail size 0-4097, chunking, thread
# count, non-finite inputs) and both against the golden values worked out from
# docs/numerics.md. Arguments go to the self-test (.ci/run passes --quick).
#
#   bash scripts/neon_check.sh [--quick]
#
# Needs aarch64-linux-gnu-gcc and qemu-aarch64; run as root on Debian/Ubuntu it installs them
# (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user). AB_AARCH64_CC and AB_QEMU_AARCH64
# name other binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

cc=${AB_AARCH64_CC:-aarch64-linux-gnu-gcc}
qemu=${AB_QEMU_AARCH64:-qemu-aarch64}
if ! command -v "$cc" >/dev/null || ! command -v "$qemu" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "neon_check: installing the AArch64 cross compiler and qemu-user"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
    else
        echo "neon_check: needs $cc and $qemu; as root on Debian: apt-get install" \
             "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user" >&2
        exit 1
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The library as build.py compiles it (its common flags; NEON needs none), so a source that
# only breaks under the real flags for AArch64 fails here too.
"$cc" -O3 -fno-math-errno -ffp-contract=off -fPIC -fvisibility=hidden -fno-lto -pthread \
    -std=c11 -Wall -shared -o "$work/libadambridge.so" adambridge/csrc/*.c -lm
# The self-test, static so that qemu needs no AArch64 sysroot.
"$cc" -O2 -pthread -static -fno-math-errno -o "$work/selftest" tests/native/selftest.c -lm
"$qemu" "$work/selftest" "$@" | tee "$work/log"
if ! grep -q "^isa neon   compiled 1 supported 1" "$work/log"; then
    echo "neon_check: the NEON kernel was not compiled in or not run" >&2
    exit 1
fi
echo "neon_check: NEON passed under $qemu"
