#!/usr/bin/env bash
# macOS in CI without a Mac: both native libraries cross-compiled and linked with zig cc for
# aarch64-macos (NEON) and x86_64-macos (AVX2, AVX-512), by build.py's and torch_build.py's
# own code (scripts/cross_build.py); any compiler or linker warning fails. Compiled and linked
# only: nothing here runs them.
#
#   bash scripts/cross_check.sh
#
# The C++ metadata library (csrc_torch/) is built against torch's macOS arm64 wheel of the
# version installed here, for this Python's version (its headers and, for arm64, its
# libraries). torch publishes no x86-64 macOS wheel of current versions, so for x86_64-macos
# it is compiled against the arm64 wheel's headers and linked against empty x86-64 stand-ins
# for torch's three libraries (every torch symbol is then left to load time, as
# -undefined dynamic_lookup allows).
# Downloads (ziglang, torch's wheel: about 150 MB) stay in AB_CROSS_WORK (default
# /tmp/adambridge-cross) for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=${AB_CROSS_WORK:-/tmp/adambridge-cross}
mkdir -p "$work"
say() { echo "cross_check: $*"; }

if ! PYTHONPATH=$work/zig python -c "import ziglang" 2>/dev/null; then
    say "installing ziglang into $work/zig"
    python -m pip install --quiet --target "$work/zig" ziglang
fi
torch_version=$(python -c "import torch; print(torch.__version__.split('+')[0])")
pyver=$(python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
mac=$work/torch-macos-$torch_version-py$pyver
if [ ! -d "$mac/torch/include" ]; then
    say "torch $torch_version's macOS arm64 wheel for Python $pyver"
    rm -rf "$work/wheel" && mkdir -p "$work/wheel"
    python -m pip download --quiet --no-deps --only-binary=:all: --platform macosx_15_0_arm64 \
        --python-version "$pyver" -d "$work/wheel" "torch==$torch_version"
    rm -rf "$mac" && mkdir -p "$mac"
    python -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(('torch/include/', 'torch/lib/'))])" \
        "$work"/wheel/torch-*.whl "$mac"
fi

# NOTE: zig builds libc++ for a target the first time it links C++ for it: minutes, past the
# 120 s a build on a user's machine may take.
export ADAMBRIDGE_BUILD_TIMEOUT=${ADAMBRIDGE_BUILD_TIMEOUT:-1800}
status=0
for target in aarch64-macos x86_64-macos; do
    out=$work/out-$target
    rm -rf "$out"
    torch_root=$mac/torch
    if [ "$target" = x86_64-macos ]; then
        # the arm64 wheel's headers, and empty x86-64 stand-ins for torch's three libraries
        torch_root=$work/x86_64-torch
        rm -rf "$torch_root" && mkdir -p "$torch_root/lib"
        ln -s "$mac/torch/include" "$torch_root/include"
        for name in torch_python torch_cpu c10; do   # empty stubs: -l finds them, links nothing
            PYTHONPATH=$work/zig python -m ziglang cc -target "$target" -shared \
                -o "$torch_root/lib/lib$name.dylib" -x c /dev/null
        done
    fi
    if ! PYTHONPATH=$repo:$work/zig python scripts/cross_build.py "$target" darwin "$out" "$torch_root"; then
        status=1
    fi
done
[ "$status" = 0 ] && say "both libraries built for aarch64-macos and x86_64-macos without a warning"
exit "$status"
