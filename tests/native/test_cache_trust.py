"""The kernel cache as a security boundary: which directories are trusted, what is created, and that only the verified file is loaded.

another local user must never get their library loaded into this process. Tests
that need a second user run only as root (which can chown, and act as ``nobody`` through
``setpriv``); they skip with that reason elsewhere.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest

from adambridge._native import build, cache as cachemod, loader, trusted
from test_build import MINI_MAIN, NATIVE_INIT, NATIVE_ONLY, _fresh_memos, _runtime_warnings, cache, mini_src  # noqa: F401

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX ownership, mode bits and directory fds")
if os.name != "nt":
    import pwd  # (Windows has no pwd module; every test here skips there)

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: only root can give a file to another user")

EVIL_C = textwrap.dedent("""\
    #include <fcntl.h>
    #include <unistd.h>
    __attribute__((constructor)) static void planted(void) {
        int fd = open("%(marker)s", O_WRONLY | O_CREAT, 0644);
        if (fd >= 0) close(fd);
    }
    int ab_abi_version(void) { return %(abi)d; }
    """)


def _nobody() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def _setpriv_or_skip() -> list:
    if not IS_ROOT:
        pytest.skip("needs root: the attacker runs as nobody through setpriv")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run the attacker as nobody")
    uid, gid = _nobody()
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def _cc() -> tuple[str, ...]:
    return build.find_compiler().argv


def _public_base() -> Path:
    """A root-owned 0755 dir under /tmp that `nobody` can reach (pytest's tmp_path is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="adambridge-trust-"))
    base.chmod(0o755)
    return base


def _plant(base: Path, where: Path, key: str) -> Path:
    """An attacker's cache in where: a library whose constructor creates base/marker, with a
    manifest that records its true sha256, all owned by nobody. Returns the marker path."""
    marker = base / "marker"
    (base / "evil.c").write_text(EVIL_C % {"marker": marker, "abi": build.abi_version()})
    keydir = where / key
    keydir.mkdir(parents=True)
    lib = keydir / build.LIB_NAME
    subprocess.run([*_cc(), "-shared", "-fPIC", "-o", str(lib), str(base / "evil.c")], check=True)
    (keydir / build.MANIFEST).write_text(json.dumps({"sha256": trusted.sha256(lib.read_bytes()), "dropped": {}}))
    uid, gid = _nobody()
    for path in (where, keydir, lib, keydir / build.MANIFEST):
        os.chown(path, uid, gid)
    where.chmod(0o700)
    keydir.chmod(0o700)
    return marker


def _messages(record) -> list:
    return [str(w.message) for w in _runtime_warnings(record)]


# -- which directories are trusted -----------------------------------------------------------------

@pytest.mark.parametrize("mode, private", [(0o777, True), (0o1777, False), (0o775, True), (0o755, False)],
                         ids=["world-writable", "sticky", "group-writable", "plain"])
def test_cache_parent_mode_decides_trust(mini_src, tmp_path, mode, private):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lib, built = loader._dlopen(mini_src, parent / "cache")
    assert built.private == private and lib.ab_abi_version() == build.abi_version()
    messages = _messages(record)
    if private:
        assert len(messages) == 1
        assert re.search(rf"{parent} is group- or world-writable without the sticky bit \(mode "
                         rf"{mode:#o}\).*private temporary directory.*python -m adambridge info", messages[0])
        assert not (parent / "cache").exists()  # refused before anything is created in it
    else:
        assert messages == [] and built.path.parent.parent == parent / "cache"


@needs_root
def test_cache_parent_owned_by_another_user_is_refused(mini_src, tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, *_nobody())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        built = cachemod.build(mini_src, parent / "cache")
    assert built.private
    assert re.search(rf"{parent} is owned by uid {_nobody()[0]}, not by you", _messages(record)[0])


def test_cache_symlinked_root_is_followed_once_and_checked_where_it_leads(mini_src, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    built = cachemod.build(mini_src, tmp_path / "link")
    assert not built.private and built.path.parent.parent == real


def test_cache_key_dir_swapped_for_a_symlink_is_not_followed(mini_src, cache, tmp_path):
    built = cachemod.build(mini_src, cache)
    elsewhere = tmp_path / "elsewhere"
    built.path.parent.rename(elsewhere)
    built.path.parent.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = cachemod.build(mini_src, cache)
    assert again.private
    assert re.search(r"is a symbolic link", _messages(record)[0])
    with pytest.raises(trusted.Untrusted, match="symbolic link"):
        trusted.verify_library(built.path.parent, build.LIB_NAME, build.MANIFEST)


@pytest.mark.parametrize("umask", [0o002, 0o000, 0o022])
def test_cache_directories_created_are_0700_whatever_the_umask(mini_src, tmp_path, umask):
    root = tmp_path / "a" / "b" / "cache"
    previous = os.umask(umask)
    try:
        built = cachemod.build(mini_src, root)
    finally:
        os.umask(previous)
    assert not built.private
    for path in (tmp_path / "a", tmp_path / "a" / "b", root, built.path.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(built.path.stat().st_mode) == 0o755
    assert stat.S_IMODE(cachemod._make_temp("ab-test-", tmp_path).stat().st_mode) == 0o700


WALK = textwrap.dedent("""\
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("trusted", sys.argv[1])
    trusted = sys.modules["trusted"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trusted)
    print("ok", os.fstat(trusted.open_dir(sys.argv[2])).st_uid)
    """)


@pytest.mark.skipif(not hasattr(os, "O_PATH"), reason="O_PATH is Linux's: elsewhere the walk needs read permission")
def test_cache_walk_passes_a_directory_one_may_search_but_not_list():
    as_nobody = _setpriv_or_skip()
    python = next((p for p in (sys.executable, "/usr/bin/python3") if subprocess.run(
        [*as_nobody, p, "-c", "pass"], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip("needs a Python that nobody can run (sys.executable is in a private directory)")
    base = _public_base()
    try:
        (base / "trusted.py").write_bytes(Path(trusted.__file__).read_bytes())
        (base / "walk.py").write_text(WALK)
        home = base / "home"
        home.mkdir()
        home.chmod(0o711)  # as some systems make /home/<user>: others may pass, not list
        (home / "cache").mkdir(mode=0o700)
        os.chown(home / "cache", *_nobody())
        done = subprocess.run([*as_nobody, python, str(base / "walk.py"), str(base / "trusted.py"), str(home / "cache")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["ok", str(_nobody()[0])]
    finally:
        shutil.rmtree(base)


# -- only the verified file is loaded ----------------------------------------------------------------

def _mini_with_id(tmp_path: Path, ident: int) -> build.Built:
    src = tmp_path / f"src{ident}"
    src.mkdir()
    (src / "adambridge.h").write_bytes((build.CSRC / "adambridge.h").read_bytes())
    (src / "main.c").write_text(MINI_MAIN + f"AB_API int mini_id(void) {{ return {ident}; }}\n")
    root = tmp_path / f"cache{ident}"
    root.mkdir(mode=0o700)
    return cachemod.build(src, root)


def test_cache_loads_the_file_it_verified_not_what_the_path_names_later(mini_src, tmp_path):
    first, second = _mini_with_id(tmp_path, 1), _mini_with_id(tmp_path, 2)
    verified = trusted.verify_library(first.path.parent, build.LIB_NAME, build.MANIFEST)
    # After the checks, the name is made to point at another library: the verified one loads.
    first.path.parent.rename(tmp_path / "moved")
    second.path.parent.rename(first.path.parent)
    assert trusted.dlopen(verified).mini_id() == 1
    # The descriptor's /proc name must not be reused for the other file, or dlopen returns 1.
    assert trusted.dlopen(trusted.verify_library(first.path.parent, build.LIB_NAME, build.MANIFEST)).mini_id() == 2


def test_cache_without_proc_loads_a_private_copy_of_the_hashed_bytes(tmp_path, monkeypatch):
    built = _mini_with_id(tmp_path, 3)
    monkeypatch.setattr(trusted, "PROC_FD", False)
    before = set(Path(tempfile.gettempdir()).glob("adambridge-load-*"))
    lib = trusted.dlopen(trusted.verify_library(built.path.parent, build.LIB_NAME, build.MANIFEST))
    assert lib.mini_id() == 3 and not lib._name.startswith(str(built.path.parent))
    assert set(Path(tempfile.gettempdir()).glob("adambridge-load-*")) == before  # removed once mapped


@needs_root
def test_cache_planted_by_another_user_is_never_loaded(mini_src, tmp_path):
    base = _public_base()
    try:
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)  # like /tmp: nobody may create the cache root before we do
        marker = _plant(base, shared / "cache", build.make_plan(mini_src).key)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lib, built = loader._dlopen(mini_src, shared / "cache")
        assert built.private and lib.ab_abi_version() == build.abi_version()
        assert not marker.exists(), "the planted library's constructor ran"
        assert re.search(r"cache is owned by uid \d+, not by you", _messages(record)[0])
    finally:
        shutil.rmtree(base)


# -- the race: nobody swaps directories while we load ---------------------------------------------

ATTACKER_C = textwrap.dedent("""\
    /* Swap our cache and the attacker's until base/stop exists; print how many renames worked. */
    #include <stdio.h>
    #include <unistd.h>
    int main(int argc, char **argv) {
        long ok = 0;
        (void)argc;
        while (access(argv[1], F_OK) != 0) {
            ok += rename(argv[2], argv[4]) == 0;   /* ours away */
            ok += rename(argv[3], argv[2]) == 0;   /* theirs in its place */
            ok += rename(argv[2], argv[3]) == 0;   /* and back */
            ok += rename(argv[4], argv[2]) == 0;
        }
        printf("%ld\\n", ok);
        return 0;
    }
    """)

RACE_LOADS = 500  # each takes about a millisecond

VICTIM = NATIVE_ONLY + textwrap.dedent("""\
    import warnings
    warnings.simplefilter("ignore")
    private = 0
    for _ in range(int(sys.argv[4])):
        lib, built = native.loader._dlopen(sys.argv[2], sys.argv[3])
        assert lib.ab_abi_version() > 0
        private += built.private
    print(private)
    """)


@pytest.mark.parametrize("mode, private", [(0o777, True), (0o1777, False)], ids=["world-writable", "sticky"])
def test_cache_swapped_by_another_user_while_loading_never_runs_their_code(mini_src, tmp_path, mode, private):
    as_nobody = _setpriv_or_skip()
    base = _public_base()
    try:
        pub = base / "pub"
        pub.mkdir()
        ours = cachemod.build(mini_src, tmp_path / "ours")  # a complete cache of our own ...
        shutil.copytree(ours.path.parent.parent, pub / "cache", symlinks=True)  # ... in pub
        marker = _plant(base, pub / "evil", ours.key)
        pub.chmod(mode)
        attacker = base / "attacker"
        (base / "attacker.c").write_text(ATTACKER_C)
        subprocess.run([*_cc(), "-O2", "-o", str(attacker), str(base / "attacker.c")], check=True)
        swaps = subprocess.Popen([*as_nobody, str(attacker), str(base / "stop"), str(pub / "cache"),
                                  str(pub / "evil"), str(pub / "real")], stdout=subprocess.PIPE, text=True)
        try:
            victim = subprocess.run([sys.executable, "-c", VICTIM, NATIVE_INIT, str(mini_src), str(pub / "cache"),
                                     str(RACE_LOADS)], capture_output=True, text=True, timeout=120)
        finally:
            (base / "stop").touch()
            renamed = int(swaps.communicate(timeout=30)[0])
        assert victim.returncode == 0, victim.stderr
        assert not marker.exists(), "the attacker's library constructor ran in our process"
        assert int(victim.stdout) == (RACE_LOADS if private else 0)  # refused every time / never disturbed
        assert (renamed > 0) == private  # the sticky bit stops nobody renaming our cache
    finally:
        shutil.rmtree(base)
