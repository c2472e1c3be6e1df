#!/usr/bin/env bash
# Sanitizer job: build tests/native/selftest.c with AddressSanitizer and UndefinedBehaviorSanitizer
# and run it. Any report is fatal (-fno-sanitize-recover), so undefined behaviour that x86
# happens to tolerate (a misaligned store, a signed overflow) still fails CI.
#
# Usage: scripts/sanitize.sh            (CC picks the compiler; default cc)
set -euo pipefail
cd "$(dirname "$0")/.."

cc=${CC:-cc}
out=$(mktemp -d "${TMPDIR:-/tmp}/adambridge-sanitize.XXXXXX")
trap 'rm -rf "$out"' EXIT

flags=(-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all)
echo "sanitize: $cc ${flags[*]} tests/native/selftest.c"
"$cc" "${flags[@]}" -pthread -o "$out/selftest" tests/native/selftest.c -lm

# NOTE: LeakSanitizer needs ptrace; where a container forbids it, set ASAN_OPTIONS=detect_leaks=0.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
"$out/selftest"
