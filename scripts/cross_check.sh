#!/usr/bin/env bash
# macOS in CI without a Mac: both native libraries cross-compiled and linked with zig cc for
# aarch64-macos (NEON) and x86_64-macos (AVX2, AVX-512), by build.py's and torch_build.py's
# own code (scripts/cross_build.py); any compiler or linker warning fails. Compiled and linked
# only: nothing here runs them.
#
#   bash scripts/cross_check.sh
#
# The C++ metadata library (csrc_torch/) is built against torch's own macOS wheels, their
# headers and their libraries, and its imports are read back (every torch symbol bound to
# libc10 or libtorch_cpu): for aarch64-macos the arm64 wheel of the torch installed here, for
# this Python; for x86_64-macos torch 2.2.2's x86-64 wheel, the newest torch published for
# Intel Macs (PyTorch stopped building them after 2.2), so the torch such a Mac has.
# Downloads (ziglang, the two wheels: about 300 MB) stay in AB_CROSS_WORK (default
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
X86_TORCH=2.2.2   # the last torch with an x86-64 macOS wheel: cp38 to cp312
x86_pyver=$(python -c "import sys; v = min(sys.version_info[:2], (3, 12)); print(f'{v[0]}.{v[1]}')")

torch_wheel() {   # folder, version, pip platform, Python version: its torch/include and lib
    local dir=$1 version=$2 platform=$3 python=$4
    [ -d "$dir/torch/include" ] && [ -d "$dir/torch/lib" ] && return
    say "torch $version's $platform wheel for Python $python"
    rm -rf "$work/wheel" "$dir" && mkdir -p "$work/wheel" "$dir"
    python -m pip download --quiet --no-deps --only-binary=:all: --platform "$platform" \
        --python-version "$python" -d "$work/wheel" "torch==$version"
    python -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(('torch/include/', 'torch/lib/'))])" \
        "$work"/wheel/torch-*.whl "$dir"
}
arm=$work/torch-macos-arm64-$torch_version-py$pyver
x86=$work/torch-macos-x86_64-$X86_TORCH-py$x86_pyver
torch_wheel "$arm" "$torch_version" macosx_15_0_arm64 "$pyver"
torch_wheel "$x86" "$X86_TORCH" macosx_10_9_x86_64 "$x86_pyver"

# NOTE: zig builds libc++ for a target the first time it links C++ for it: minutes, past the
# 120 s a build on a user's machine may take.
export ADAMBRIDGE_BUILD_TIMEOUT=${ADAMBRIDGE_BUILD_TIMEOUT:-1800}
status=0
for target in aarch64-macos x86_64-macos; do
    out=$work/out-$target
    rm -rf "$out"
    torch_root=$arm/torch
    [ "$target" = x86_64-macos ] && torch_root=$x86/torch
    if ! PYTHONPATH=$repo:$work/zig python scripts/cross_build.py "$target" darwin "$out" "$torch_root"; then
        status=1
    fi
done
[ "$status" = 0 ] && say "both libraries built for aarch64-macos and x86_64-macos without a warning, linked against torch's wheels"
exit "$status"
