"""The kernel cache: where built libraries live, the build lock, publishing with a content hash, private builds, and the cleanup of killed builds.

A library lives in ``${ADAMBRIDGE_CACHE_DIR:-~/.cache/adambridge}/<key>/`` beside ``build.json``,
its manifest, which records the library's sha256. A build happens in a temp dir inside the
cache, under a per-key file lock, and is published with ``os.replace`` (manifest first, library
last): N processes that start at once build once, and nobody sees a half-written library.

Every directory on the way is checked through directory descriptors (trusted.py). When the
cache fails those checks, adambridge warns once and builds into a private 0700 temporary
directory instead, once per process; the loader then verifies and hashes whatever it loads.
Temp dirs are named ``.<key>.tmp-<host>-<pid>-<random>``, so the next build can tell those of
killed builds (dead pid, or older than any build may last) from a concurrent one's.

Standard library only; importing this module compiles nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from . import trusted
from .build import (CSRC, INFO_HINT, IS_WINDOWS, MANIFEST, Built, NativeBuildError, Plan,
                    _warn_once, build_timeout, cache_root, compile_into, deadline, make_plan)

log = logging.getLogger("adambridge.build")

_TEMP_NAME = re.compile(r"^\.[0-9a-f]{32}\.tmp-(?:(?P<host>.+)-(?P<pid>\d+)-)?[a-z0-9_]+$")
STALE_AFTER = 3600.0  # seconds; a temp dir older than this (and the build timeout) is dead


_held_locks: set = set()  # descriptors of the build locks this process holds now


def _drop_inherited_locks() -> None:
    # A child forked during a build (a DataLoader worker while the torch-facts library builds
    # on its thread) shares the lock's open file: flock is released only when every copy is
    # closed, so the child would hold up other processes' builds until it exits.
    for fd in list(_held_locks):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes, held for the with block (the file stays).

    NativeBuildError when the lock file cannot be opened (a symlink, a directory, no permission):
    backend="auto" then falls back to torch with one warning instead of failing every step.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        raise _lock_error(path, exc) from None
    _held_locks.add(fd)
    try:
        if IS_WINDOWS:
            import msvcrt
            while True:  # LK_LOCK gives up after ~10 s; keep waiting for the builder
                try:
                    msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
    finally:
        _held_locks.discard(fd)
        os.close(fd)  # closing also releases flock


def _lock_error(path: Path, exc: OSError) -> NativeBuildError:
    what = "it is a symbolic link" if os.path.islink(path) else exc.strerror or str(exc)
    return NativeBuildError(f"adambridge cannot open its build lock {path} ({what}); remove it "
                            f"(rm {path}: the next build makes a new one) or set ADAMBRIDGE_CACHE_DIR "
                            f"to another directory; {INFO_HINT}.")


def _open_root(root: Path) -> Optional[int]:
    """A verified descriptor for the cache root (created 0700 if missing), None on Windows."""
    if IS_WINDOWS:  # NOTE: no uid/mode bits; %LOCALAPPDATA% is per-user by default.
        root.mkdir(parents=True, exist_ok=True)
        return None
    return trusted.open_dir(root, create=True)  # root is a realpath already (see build)


def _from_cache(plan: Plan, root_fd: Optional[int], keydir: Path) -> Optional[Built]:
    """The published library in keydir, None when absent; Untrusted when unsafe to load."""
    lib = keydir / plan.lib_name
    if root_fd is None:
        if not lib.is_file():
            return None
        with contextlib.suppress(OSError, ValueError):
            return Built(lib, plan.key, plan.compiler,
                         json.loads((keydir / MANIFEST).read_text()).get("dropped", {}))
        return Built(lib, plan.key, plan.compiler)
    try:
        key_fd = trusted.open_child(root_fd, plan.key, str(keydir))
    except FileNotFoundError:
        return None
    try:
        try:
            lib_fd, _ = trusted.open_file(key_fd, plan.lib_name, str(lib))
        except FileNotFoundError:
            return None
        os.close(lib_fd)  # its content is the loader's to hash, on the descriptor it loads
        manifest = trusted.read_manifest(key_fd, MANIFEST, str(keydir / MANIFEST))
    finally:
        os.close(key_fd)
    return Built(lib, plan.key, plan.compiler, manifest.get("dropped", {}))


def _write_manifest(plan: Plan, out_dir: Path, report: dict) -> None:
    """out_dir/MANIFEST with the library's sha256 and size, written whole before it is published."""
    data = (out_dir / plan.lib_name).read_bytes()
    (out_dir / MANIFEST).write_text(json.dumps({
        "key": plan.key, "compiler": plan.compiler.describe(), "sha256": trusted.sha256(data),
        "size": len(data), **report}, indent=1))
    # NOTE: the linker honours the umask (often 002); the checks reject group-writable files.
    os.chmod(out_dir / plan.lib_name, 0o755)
    os.chmod(out_dir / MANIFEST, 0o644)


def _make_temp(prefix: str, parent: Optional[Path] = None) -> Path:
    # realpath: the loader's walk follows no symlink (TMPDIR may hold one, like macOS's /var)
    out = Path(os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=parent)))
    os.chmod(out, 0o700)  # mkdtemp asks for 0700, but the umask may take bits away
    return out


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _publish(plan: Plan, root: Path, root_fd: Optional[int], until: float) -> None:
    """Build in a temp dir inside root, then move the result into root/<key>/ with os.replace.

    Paths are safe to use here: every directory from / to root was just verified, so no other
    user can rename anything on the way.
    """
    tmp = _make_temp(f".{plan.key}.tmp-{_host()}-{os.getpid()}-", root)
    try:
        start = time.perf_counter()
        _write_manifest(plan, tmp, _compile(plan, tmp, until))
        keydir = root / plan.key
        if root_fd is None:
            keydir.mkdir(mode=0o700, exist_ok=True)
        else:
            os.close(trusted.open_child(root_fd, plan.key, str(keydir), create=True))
        os.replace(tmp / MANIFEST, keydir / MANIFEST)
        os.replace(tmp / plan.lib_name, keydir / plan.lib_name)  # last: a present library is a complete one
        log.info("adambridge: built %s in %.1f s", keydir / plan.lib_name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: alive, another user's
    return True


def _is_dead_temp(name: str, mtime: float, now: float) -> bool:
    """Whether temp dir name was left by a build that no longer runs."""
    found = _TEMP_NAME.match(name)
    if found is None:
        return False
    if now - mtime > max(STALE_AFTER, 2 * build_timeout()):
        return True
    pid = found.group("pid")
    # NOTE: os.kill(pid, 0) would send CTRL_C_EVENT on Windows; there only age decides. Our own
    # pid may be a dead build's in a container that reuses pids; age decides that too.
    if pid is None or IS_WINDOWS or found.group("host") != _host() or int(pid) == os.getpid():
        return False
    return not _pid_alive(int(pid))


def remove_dead_temps(root: Path) -> list:
    """Remove the temp dirs of killed builds in root; returns their names."""
    removed, now = [], time.time()
    for entry in os.scandir(root):
        try:
            dead = entry.is_dir(follow_symlinks=False) and \
                _is_dead_temp(entry.name, entry.stat(follow_symlinks=False).st_mtime, now)
        except OSError:
            continue  # removed meanwhile
        if dead:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.info("adambridge: removed %d temp dir(s) of killed builds in %s", len(removed), root)
    return removed


def _remove_if_unchanged(keydir: Path, lib_name: str, broken: trusted.Damaged) -> None:
    """Under the lock: delete the library that failed, unless another process replaced it since."""
    try:
        now = os.lstat(keydir / lib_name)
    except FileNotFoundError:
        return
    if broken.st is not None and trusted.same_file(now, broken.st):
        for name in (lib_name, MANIFEST):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(keydir / name)


_private: dict = {}


def _private_build(plan: Plan, reason: str, until: Optional[float] = None) -> Built:
    """Build into a fresh 0700 mkdtemp() dir that only this process uses (once per process)."""
    _warn_once("insecure-cache",
               f"adambridge does not use its build cache because {reason}; it builds into a private "
               f"temporary directory instead, once per process. Make every directory on the cache "
               f"path yours or root's and writable by nobody else (a sticky one like /tmp is fine "
               f"above it), or set ADAMBRIDGE_CACHE_DIR to one that is; {INFO_HINT}.")
    known = _private.get(plan.key)
    if known is None:
        out = _make_temp("adambridge-")
        atexit.register(shutil.rmtree, out, True)
        report = _compile(plan, out, until)
        _write_manifest(plan, out, report)
        log.info("adambridge: built %s (private)", out / plan.lib_name)
        known = _private[plan.key] = Built(out / plan.lib_name, plan.key, plan.compiler, report["dropped"],
                                           private=True, fresh=True)
    return known


def _compile(plan: Plan, out_dir: Path, until: float) -> dict:
    return (plan.compile or compile_into)(plan, out_dir, until)


def _plan_for(src_dir: Optional[Path], planner: Optional[Callable], until: float) -> Plan:
    if planner is not None:
        return planner(until)
    return make_plan(Path(src_dir) if src_dir is not None else CSRC, until=until)


def build_private(src_dir: Optional[Path], reason: str, planner: Optional[Callable] = None) -> Built:
    """The private build of src_dir (see _private_build), for a cache that failed at load time."""
    until = deadline()
    return _private_build(_plan_for(src_dir, planner, until), reason, until)


def build(src_dir: Optional[Path] = None, cache_dir: Optional[Path] = None, *,
          broken: Optional[trusted.Damaged] = None, planner: Optional[Callable] = None) -> Built:
    """The library for src_dir, from the cache or compiled now (once across processes).

    broken: why the loader could not use the cached library; unless another process has
    replaced that file meanwhile, it is deleted and built again. planner: until -> Plan, for a
    library other than the kernel's (torch_build.plan); src_dir is then not used.
    """
    until = deadline()  # one bound for discovery and every compiler call of this build
    plan = _plan_for(src_dir, planner, until)
    root = Path(os.path.realpath(cache_dir if cache_dir is not None else cache_root()))
    try:
        root_fd = _open_root(root)
    except trusted.Untrusted as exc:
        return _private_build(plan, str(exc), until)
    except OSError as exc:
        return _private_build(plan, f"{root} cannot be created ({exc.strerror})", until)
    keydir = root / plan.key
    try:
        if broken is None:
            found = _from_cache(plan, root_fd, keydir)  # the fast path: no lock once published
            if found is not None:
                return found
        with _file_lock(root / f"{plan.key}.lock"):
            if broken is not None:
                _remove_if_unchanged(keydir, plan.lib_name, broken)
            found = _from_cache(plan, root_fd, keydir)  # another process may have built it meanwhile
            if found is None:
                remove_dead_temps(root)
                _publish(plan, root, root_fd, until)
                found = dataclasses.replace(_from_cache(plan, root_fd, keydir), fresh=True)
        return found
    except trusted.Untrusted as exc:
        return _private_build(plan, str(exc), until)
    finally:
        if root_fd is not None:
            os.close(root_fd)
