"""Building and loading the native library: cache key, atomic publish, locking, security, fallbacks.

Tests about the build machinery compile a tiny source tree in tmp_path (one small C file plus
the real header), which takes well under a second; tests about the real library share the
session cache that conftest.py sets up, so the kernel is built once per run.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from adambridge._native import build, cache as cachemod, loader
from conftest import NEEDS_FORK

X86 = build.machine() == "x86_64"

MINI_MAIN = textwrap.dedent("""\
    #include "adambridge.h"
    AB_API int ab_abi_version(void) { return AB_ABI_VERSION; }
    AB_API int mini_has_avx512(void) {
    #ifdef AB_NO_AVX512
        return 0;
    #else
        return 1;
    #endif
    }
    """)
MINI_AVX2 = "#include <immintrin.h>\n__m256 mini_fma(__m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, a); }\n"


def _compiler_or_skip() -> build.Compiler:
    try:
        return build.find_compiler()
    except build.NoCompilerError as exc:
        pytest.skip(f"no C compiler: {exc}")


@pytest.fixture(autouse=True)
def _fresh_memos():
    loader.reset()
    yield
    loader.reset()


@pytest.fixture
def mini_src(tmp_path) -> Path:
    """A tiny source tree: the real header and one common file (ISA files are added by tests)."""
    _compiler_or_skip()
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "adambridge.h").write_bytes((build.CSRC / "adambridge.h").read_bytes())
    (src / "main.c").write_text(MINI_MAIN)
    return src


@pytest.fixture
def cache(tmp_path) -> Path:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    return path


def _runtime_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, RuntimeWarning)]


# -- the cache key ---------------------------------------------------------------------------------

def test_cache_key_changes_when_a_source_changes(mini_src):
    before = build.make_plan(mini_src).key
    assert build.make_plan(mini_src).key == before
    (mini_src / "main.c").write_text(MINI_MAIN + "/* edited */\n")
    assert build.make_plan(mini_src).key != before


def test_cache_key_changes_with_compiler_identity_and_abi(mini_src):
    compiler = build.find_compiler()
    before = build.make_plan(mini_src, compiler).key
    other = build.Compiler(compiler.argv, compiler.identity + " patched")
    assert build.make_plan(mini_src, other).key != before
    header = mini_src / "adambridge.h"
    header.write_text(re.sub(r"#define AB_ABI_VERSION \d+", "#define AB_ABI_VERSION 99", header.read_text()))
    assert build.abi_version(mini_src) == 99
    assert build.make_plan(mini_src, compiler).key != before


# -- building and publishing -----------------------------------------------------------------------

def test_build_publishes_atomically(mini_src, cache, monkeypatch):
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        src, dst = Path(src), Path(dst)
        assert src.parent.parent == cache and src.parent.name.startswith(f".{dst.parent.name}.tmp-")
        assert not dst.exists() and src.stat().st_size > 0
        replaced.append(dst.name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    built = cachemod.build(mini_src, cache)
    assert replaced == [build.MANIFEST, build.LIB_NAME]  # the library last: present means complete
    assert built.path == cache / built.key / build.LIB_NAME and not built.private
    assert sorted(p.name for p in cache.iterdir()) == [built.key, f"{built.key}.lock"]  # no temp left
    assert ctypes.CDLL(str(built.path)).ab_abi_version() == build.abi_version()
    assert built.fresh and stat.S_IMODE(built.path.parent.stat().st_mode) == 0o700
    manifest = json.loads((built.path.parent / build.MANIFEST).read_text())
    assert manifest["sha256"] == hashlib.sha256(built.path.read_bytes()).hexdigest()
    again = cachemod.build(mini_src, cache)
    assert again.path == built.path and not again.fresh and len(replaced) == 2  # a hit builds nothing


# Imports adambridge._native alone, as package "ab_native", so a process starts in milliseconds
# (adambridge/__init__ would import torch).
NATIVE_ONLY = textwrap.dedent("""\
    import importlib.util, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    spec = importlib.util.spec_from_file_location("ab_native", sys.argv[1],
                                                  submodule_search_locations=[sys.argv[1].rpartition("/")[0]])
    native = importlib.util.module_from_spec(spec)
    sys.modules["ab_native"] = native
    spec.loader.exec_module(native)
    """)
NATIVE_INIT = str(Path(build.__file__).with_name("__init__.py"))

_CONCURRENT = NATIVE_ONLY + textwrap.dedent("""\
    lib, built = native.loader._dlopen(sys.argv[2], sys.argv[3])
    print(lib.ab_abi_version(), built.path)
    """)


def test_build_concurrent_processes_build_once(mini_src, cache):
    # The eight really race for the lock: each loads only adambridge._native (see NATIVE_ONLY).
    argv = [sys.executable, "-c", _CONCURRENT, NATIVE_INIT, str(mini_src), str(cache)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    assert len({out for _, out, _ in results}) == 1
    assert results[0][1].split()[0] == str(build.abi_version())
    builds = sum(err.count("adambridge: built") for _, _, err in results)
    assert builds == 1


@pytest.mark.skipif(os.name == "nt", reason="POSIX ownership and mode bits")
@pytest.mark.parametrize("target", ["root", "keydir", "library"])
def test_build_insecure_cache_builds_privately_and_warns_once(mini_src, cache, target):
    if target == "root":
        cache.chmod(0o777)
    else:
        built = cachemod.build(mini_src, cache)
        (built.path.parent if target == "keydir" else built.path).chmod(0o775)
        loader.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = cachemod.build(mini_src, cache)
        second = cachemod.build(mini_src, cache)
    assert first.private and first == second
    assert cache not in first.path.parents
    assert ctypes.CDLL(str(first.path)).ab_abi_version() == build.abi_version()
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1
    assert re.search(r"group- or world-writable .*private temporary directory.*python -m adambridge info",
                     messages[0])


def test_build_corrupt_cached_library_is_rebuilt(mini_src, cache):
    built = cachemod.build(mini_src, cache)
    built.path.write_bytes(b"not a shared library")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lib, rebuilt = loader._dlopen(mini_src, cache)
    assert lib.ab_abi_version() == build.abi_version()
    assert rebuilt.path == built.path and built.path.stat().st_size > 100
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1 and "deletes it and builds it again" in messages[0]


@pytest.mark.skipif(not X86, reason="the ISA files of this test are x86")
def test_build_drops_an_isa_that_does_not_compile(mini_src, cache):
    (mini_src / "kernel_avx2.c").write_text(MINI_AVX2)  # compiles only with its own -mavx2 -mfma
    (mini_src / "kernel_avx512.c").write_text("#error this compiler is too old\n")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        built = cachemod.build(mini_src, cache)
    assert set(built.dropped) == {"avx512"} and "too old" in built.dropped["avx512"]
    flags = json.loads((built.path.parent / build.MANIFEST).read_text())["flags"]
    assert "-mavx2" in flags["kernel_avx2.c"] and "-DAB_NO_AVX512" in flags["main.c"]
    assert not any(f.startswith("-march") for f in flags["main.c"])
    assert ctypes.CDLL(str(built.path)).mini_has_avx512() == 0  # common files got -DAB_NO_AVX512
    assert any("without avx512" in str(w.message) for w in _runtime_warnings(record))
    assert cachemod.build(mini_src, cache).dropped == built.dropped  # read back from the manifest


def test_build_failure_raises_with_compiler_output(mini_src, cache):
    (mini_src / "main.c").write_text(MINI_MAIN + "int broken(void) { return }\n")
    message = r"could not build its native kernel: compiling main\.c .*error.*ADAMBRIDGE_CC.*python -m adambridge info"
    with pytest.raises(build.NativeBuildError, match=message):
        cachemod.build(mini_src, cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_compiler_env_comes_first(mini_src, cache, tmp_path, monkeypatch):
    real = build.find_compiler()
    if real.msvc:
        pytest.skip("MSVC cl found: the wrapper compiler is a POSIX shell script (needs gcc or clang)")
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "my-cc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {" ".join(real.argv)} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("ADAMBRIDGE_CC", str(wrapper))
    assert build.find_compiler().argv == (str(wrapper),)
    cachemod.build(mini_src, cache)
    assert "--version" in log.read_text() and "main.c" in log.read_text()


def test_compiler_env_that_does_not_run_is_skipped_with_a_warning(monkeypatch):
    _compiler_or_skip()
    monkeypatch.setenv("ADAMBRIDGE_CC", "/nonexistent/cc")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiler = build.find_compiler()
        build.find_compiler()
    assert compiler.argv != ("/nonexistent/cc",)
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1 and "ignores ADAMBRIDGE_CC=/nonexistent/cc: not found" in messages[0]


# -- the loader ------------------------------------------------------------------------------------

def test_loader_without_compiler_falls_back_with_one_warning(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("ADAMBRIDGE_CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("ADAMBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ADAMBRIDGE_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("ADAMBRIDGE_ISA", raising=False)
    monkeypatch.setattr(build, "_have_ziglang", lambda: False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert loader.native_or_none() is None
        assert loader.native_or_none() is None
        assert loader.backend_name() == "torch"
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1
    assert re.search(r"no working C compiler \(tried ADAMBRIDGE_CC=/nonexistent/cc: not found; cc: ",
                     messages[0])
    assert "python -m adambridge info" in messages[0]
    with pytest.raises(build.NoCompilerError):
        loader.load()


def test_loader_disable_native_gives_torch_without_warning(monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_DISABLE_NATIVE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.native_or_none() is None
        assert loader.backend_name() == "torch"
        assert loader.compiled_isas() == () and loader.set_num_threads(2) is False
    with pytest.raises(build.NativeBuildError, match="ADAMBRIDGE_DISABLE_NATIVE"):
        loader.load()


def test_loader_unknown_isa_env_raises(monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_ISA", "bogus")
    match = r"ADAMBRIDGE_ISA='bogus' is not an instruction set; valid: scalar, avx2, avx512, neon"
    with pytest.raises(ValueError, match=match):
        loader.load()
    with pytest.raises(ValueError, match=match):
        loader.native_or_none()


def test_loader_unsupported_isa_env_raises(monkeypatch):
    foreign = "neon" if X86 else "avx2"
    monkeypatch.setenv("ADAMBRIDGE_ISA", foreign)
    _compiler_or_skip()
    with pytest.raises(ValueError, match=rf"ADAMBRIDGE_ISA='{foreign}' is not supported here.*supported: scalar"):
        loader.load()


def test_loader_forced_isa_is_active(monkeypatch):
    _compiler_or_skip()
    monkeypatch.setenv("ADAMBRIDGE_ISA", "scalar")
    assert loader.load().lib.ab_isa_active() == 0
    assert loader.backend_name() == "native/scalar"
    monkeypatch.delenv("ADAMBRIDGE_ISA")
    loader.reset()
    assert loader.isa_name() == loader.detected_isa()  # unforced: back to the best ISA
    assert set(loader.supported_isas()) <= set(loader.compiled_isas())


def test_loader_prototypes_cover_every_abi_function():
    header = (build.CSRC / "adambridge.h").read_text()
    declared = set(re.findall(r"^AB_API\s+[\w\s\*]+?\**\b(ab_\w+)\s*\(", header, re.M))
    assert declared == set(loader.PROTOTYPES)


def test_loader_struct_layout_matches_header(tmp_path):
    compiler = _compiler_or_skip()
    if compiler.msvc:
        pytest.skip("MSVC cl found: the layout program needs a gcc-style compiler (gcc or clang)")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "adambridge.h"', "int main(void) {"]
    for struct, cname in ((loader.AbHyper, "ab_hyper"), (loader.AbTensor, "ab_tensor")):
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        lines += [f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));' for f, _ in struct._fields_]
    (tmp_path / "layout.c").write_text("\n".join(lines + ["return 0; }"]))
    exe = tmp_path / "layout"
    subprocess.run([*compiler.argv, f"-I{build.CSRC}", str(tmp_path / "layout.c"), "-o", str(exe)],
                   check=True, capture_output=True)
    printed = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    expected = []
    for struct, cname in ((loader.AbHyper, "ab_hyper"), (loader.AbTensor, "ab_tensor")):
        expected.append(f"{cname} sizeof {ctypes.sizeof(struct)}")
        expected += [f"{cname} {f} {getattr(struct, f).offset}" for f, _ in struct._fields_]
    assert printed[:-1] == expected


def test_loader_update_rejects_a_non_contiguous_tensor():
    torch = pytest.importorskip("torch")
    from adambridge.update import functional
    n = 16
    hyper = functional.Hyper.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    item = functional.UpdateItem(
        master=torch.zeros(2 * n)[::2], grad=torch.zeros(n), exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n), exp_avg_scale=None, exp_avg_sq_scale=None, out=None,
        offset=0, key=0, precision="fp32", stochastic_rounding=False, hyper=hyper)
    with pytest.raises(ValueError, match=r"Invalid master: the native kernel needs a contiguous CPU tensor"):
        loader._ab_tensor(item)


def test_import_compiles_nothing(tmp_path):
    code = ("import adambridge, adambridge.cli, adambridge.host.topology, adambridge._native as n; "
            "assert n.loader._load.cache_info().currsize == 0")
    env = dict(os.environ, ADAMBRIDGE_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert not (tmp_path / "cache").exists()


@NEEDS_FORK
def test_a_child_forked_during_a_build_does_not_hold_its_lock(tmp_path):
    # Another process waiting for the lock must get it once the parent is done, even while
    # a child forked in the middle of the build (a DataLoader worker) still runs.
    import fcntl
    import signal
    lock = tmp_path / "k.lock"
    ready_r, ready_w = os.pipe()
    with cachemod._file_lock(lock):
        child = os.fork()
        if child == 0:  # pragma: no cover - the child says it runs, then waits to be killed
            import time
            os.write(ready_w, b"1")  # (the at-fork handlers have run by now)
            time.sleep(60)
            os._exit(0)
    os.read(ready_r, 1)
    os.close(ready_r)
    os.close(ready_w)
    try:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
        finally:
            os.close(fd)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
