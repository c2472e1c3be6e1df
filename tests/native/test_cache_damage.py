"""A damaged cached library: caught by its hash before dlopen, deleted and rebuilt with one warning, and the check's cost at import.

``dlopen`` of a truncated ELF file dies of SIGBUS (``Fatal Python error: Bus error``),
so every truncation runs in a subprocess: a crash is then a failed test, not a dead pytest.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from adambridge._native import build, cache as cachemod, loader, trusted
from test_build import NATIVE_INIT, NATIVE_ONLY, _fresh_memos, _runtime_warnings, cache, mini_src  # noqa: F401

LOAD_ONCE = NATIVE_ONLY + textwrap.dedent("""\
    import warnings
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lib, built = native.loader._dlopen(sys.argv[2], sys.argv[3])
    print(lib.ab_abi_version(), built.path.stat().st_size)
    for w in record:
        print("WARNING", w.message)
    """)


@pytest.mark.parametrize("length", [0, 1000, 0.25, 0.5, -1], ids=["empty", "1000-bytes", "quarter", "half", "all-but-one"])
def test_cache_truncated_library_is_rebuilt_with_one_warning(mini_src, cache, length):
    built = cachemod.build(mini_src, cache)
    size = built.path.stat().st_size
    cut = size - 1 if length == -1 else int(size * length) if isinstance(length, float) else length
    os.truncate(built.path, cut)
    done = subprocess.run([sys.executable, "-c", LOAD_ONCE, NATIVE_INIT, str(mini_src), str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[0] == f"{build.abi_version()} {size}"  # the same library, whole again
    warned = [ln for ln in lines[1:] if ln.startswith("WARNING")]
    assert len(warned) == 1
    assert f"{built.path} ({cut} bytes) does not match the sha256" in warned[0]
    assert "deletes it and builds it again" in warned[0]


def test_cache_library_without_a_recorded_hash_is_rebuilt(mini_src, cache):
    built = cachemod.build(mini_src, cache)
    manifest = built.path.parent / build.MANIFEST
    manifest.write_text(json.dumps({"dropped": {}}))  # as a build from before the hash was kept
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lib, again = loader._dlopen(mini_src, cache)
    assert lib.ab_abi_version() == build.abi_version() and not again.private
    assert "sha256" in json.loads(manifest.read_text())
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1 and "records no sha256" in messages[0]


def test_cache_library_that_matches_its_hash_but_does_not_load_is_rebuilt(mini_src, cache):
    built = cachemod.build(mini_src, cache)
    garbage = b"\x7fELF but not really a shared library"
    built.path.write_bytes(garbage)  # a manifest that agrees: only dlopen can tell
    manifest = built.path.parent / build.MANIFEST
    manifest.write_text(json.dumps({"sha256": trusted.sha256(garbage), "dropped": {}}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lib, again = loader._dlopen(mini_src, cache)
    assert lib.ab_abi_version() == build.abi_version() and again.fresh
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1
    assert f"cached library: {built.path} does not load (" in messages[0] and "/proc/self" not in messages[0]


def test_cache_repair_keeps_a_library_another_process_already_rebuilt(mini_src, cache):
    built = cachemod.build(mini_src, cache)
    failed = trusted.Damaged("it did not load", built.path.stat())
    built.path.unlink()
    rebuilt = cachemod.build(mini_src, cache)  # another process repaired it first
    inode = rebuilt.path.stat().st_ino
    again = cachemod.build(mini_src, cache, broken=failed)
    assert again.path.stat().st_ino == inode and not again.fresh


def test_cache_library_that_does_not_load_even_rebuilt_is_an_error(mini_src, cache, monkeypatch, caplog):
    cachemod.build(mini_src, cache)
    caplog.set_level(logging.INFO, logger="adambridge.build")

    def refuse(verified):
        os.close(verified.fd)
        raise trusted.Damaged("invalid ELF header", verified.st)

    monkeypatch.setattr(trusted, "dlopen", refuse)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(build.NativeBuildError, match=r"built .* but cannot load it \(invalid ELF header\)"
                                                         r".*python -m adambridge info"):
            loader._dlopen(mini_src, cache)
    assert sum("adambridge: built" in r.getMessage() for r in caplog.records) == 1  # deleted, built again
    assert len(_runtime_warnings(record)) == 1


def test_cache_hash_check_at_import_is_under_a_millisecond(tmp_path):
    # The real library is about 270 KB; time the whole check (walk, fstat, read, sha256) on 300 KB.
    keydir = tmp_path / "key"
    keydir.mkdir(mode=0o700)
    data = os.urandom(300_000)
    (keydir / build.LIB_NAME).write_bytes(data)
    (keydir / build.MANIFEST).write_text(json.dumps({"sha256": trusted.sha256(data)}))
    times = []
    for _ in range(51):
        start = time.perf_counter()
        os.close(trusted.verify_library(keydir, build.LIB_NAME, build.MANIFEST).fd)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 1e-3, f"median {statistics.median(times) * 1e3:.3f} ms"
