"""Verified opening of cache files: the directory-fd walk, owner and mode checks, the content hash, and dlopen of that very file.

The library in the cache is code that runs in this process, so no other local user may choose
it. A cache path is therefore never trusted by name. It is walked from ``/`` with one
directory file descriptor per component (``O_DIRECTORY | O_NOFOLLOW``), and each component is
accepted only when it is owned by this user or root and nobody else can rename its entries: not
group- or world-writable, unless sticky like ``/tmp``. The last directory must be this user's
own and writable by nobody else. The library is then opened through the verified directory
descriptor, its owner and mode are checked with ``fstat`` on that open file, its bytes are
hashed and compared with the sha256 recorded in the manifest when it was published, and the
dynamic loader is handed exactly that open file (``/proc/self/fd/N``), or, where there is no
``/proc``, a private copy of the very bytes that were hashed.

A file that fails the hash (truncated, overwritten, half-written by a disk fault) raises
``Damaged`` before ``dlopen`` ever maps it; ``dlopen`` of a truncated ELF file dies of SIGBUS.
Anything another user could have changed raises ``Untrusted``. Standard library only.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

IS_WINDOWS = sys.platform == "win32"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# NOTE: O_PATH (Linux) opens a directory one may search but not list, such as a 0711 home.
_DIR_FLAGS = (getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) |
              getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC | getattr(os, "O_BINARY", 0)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
# NOTE: dlopen("/proc/self/fd/N") maps the file that descriptor N has open, not a path anyone
# can rename; where /proc is missing (macOS, BSD) a private copy of the hashed bytes is loaded.
PROC_FD = os.path.isdir("/proc/self/fd")


class Rejected(Exception):
    """A cache file or directory that must not be loaded; str() says which one and why."""


class Untrusted(Rejected):
    """Another user could change what is loaded from there (owner, mode, symlink, not openable)."""


class Damaged(Rejected):
    """The library is missing, does not match the sha256 recorded when it was published, or
    does not load; st is the fstat of the file that failed, None when there was none."""

    def __init__(self, message: str, st: Optional[os.stat_result] = None):
        super().__init__(message)
        self.st = st


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


@dataclass(frozen=True)
class Verified:
    """An open library whose owner, mode and sha256 were checked on this very descriptor."""
    fd: int
    shown: str                  # its path, for messages only
    data: bytes                 # the bytes that were hashed
    st: os.stat_result


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the owner and mode rules --------------------------------------------------------------------

def _check(st: os.stat_result, shown: str, *, mine: bool, directory: bool) -> None:
    """Untrusted unless st is a directory (or regular file) no other user can change."""
    uid = os.geteuid()
    if directory and not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{shown} is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{shown} is not a regular file")
    if st.st_uid != uid and (mine or st.st_uid != 0):
        whom = f"you (uid {uid})" if mine else f"you (uid {uid}) or root"
        raise Untrusted(f"{shown} is owned by uid {st.st_uid}, not by {whom}, so that user could "
                        f"replace the library adambridge loads")
    mode = st.st_mode
    if mode & _OTHERS_WRITE and (mine or not directory or not mode & stat.S_ISVTX):
        sticky = "" if mine or not directory else " without the sticky bit"
        raise Untrusted(f"{shown} is group- or world-writable{sticky} (mode {stat.S_IMODE(mode):#o}), "
                        f"so another user could replace the library adambridge loads")


def _open_dir_at(dir_fd: Optional[int], name: str, shown: str) -> int:
    """os.open of a directory that is not a symlink; FileNotFoundError passes through."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR; EACCES
        if os.path.islink(shown):
            raise Untrusted(f"{shown} is a symbolic link, which adambridge does not follow there "
                            f"(someone may have swapped it in)") from None
        raise Untrusted(f"{shown} cannot be opened as a directory ({exc.strerror})") from None


def _make_dir(dir_fd: int, name: str) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return  # made meanwhile (a concurrent build); the open and checks that follow judge it
    # NOTE: mkdir's mode is masked by the umask; this makes it exactly 0700. The
    # parent was verified, so no other user can have swapped the name since mkdir.
    os.chmod(name, 0o700, dir_fd=dir_fd)


def open_child(dir_fd: int, name: str, shown: str, *, create: bool = False, mine: bool = True) -> int:
    """A verified descriptor for directory name inside the verified dir_fd."""
    try:
        fd = _open_dir_at(dir_fd, name, shown)
    except FileNotFoundError:
        if not create:
            raise
        _make_dir(dir_fd, name)
        fd = _open_dir_at(dir_fd, name, shown)
    try:
        _check(os.fstat(fd), shown, mine=mine, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(path, *, create: bool = False, resolve: bool = False) -> int:
    """A descriptor for directory path, every component from / verified (see module doc).

    The last component must be this user's; create makes missing ones, 0700 whatever the umask.
    resolve: resolve symlinks in path first (for a path the user configured). Raises Untrusted,
    or FileNotFoundError when a component is missing and create is False.
    """
    # NOTE: symlinks are resolved once, by name, and only when asked; the walk follows none and
    # checks every directory the path passes through, so a link can only lead to a checked place.
    names = [n for n in (os.path.realpath(path) if resolve else os.path.abspath(path)).split(os.sep) if n]
    fd = _open_dir_at(None, "/", "/")
    try:
        _check(os.fstat(fd), "/", mine=not names, directory=True)
        shown = ""
        for i, name in enumerate(names):
            shown += "/" + name
            child = open_child(fd, name, shown, create=create, mine=i == len(names) - 1)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- reading files through a verified directory ----------------------------------------------------

def open_file(dir_fd: int, name: str, shown: str) -> tuple[int, os.stat_result]:
    """(fd, fstat) of regular file name in dir_fd, owned by this user and writable by nobody else."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink
        raise Untrusted(f"{shown} cannot be opened without following a link ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        _check(st, shown, mine=True, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def read_manifest(dir_fd: int, name: str, shown: str) -> dict:
    """The JSON object in name, {} when it is missing or not JSON; Untrusted as open_file."""
    try:
        fd, _ = open_file(dir_fd, name, shown)
    except FileNotFoundError:
        return {}
    try:
        found = json.loads(read_all(fd))
    except ValueError:
        return {}
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else {}


def verify_in(dir_fd: int, dir_shown: str, lib_name: str, manifest_name: str) -> Verified:
    """The library lib_name in the verified dir_fd, opened and hashed; Damaged or Untrusted."""
    shown = f"{dir_shown}/{lib_name}"
    expected = read_manifest(dir_fd, manifest_name, f"{dir_shown}/{manifest_name}").get("sha256")
    try:
        fd, st = open_file(dir_fd, lib_name, shown)
    except FileNotFoundError:
        raise Damaged(f"{shown} is missing") from None
    try:
        data = read_all(fd)
        if not isinstance(expected, str):
            raise Damaged(f"{dir_shown}/{manifest_name} records no sha256 for {lib_name}", st)
        if sha256(data) != expected:
            raise Damaged(f"{shown} ({len(data)} bytes) does not match the sha256 recorded when "
                          f"it was built, so it is truncated or overwritten", st)
    except BaseException:
        os.close(fd)
        raise
    return Verified(fd, shown, data, st)


def verify_library(directory: Path, lib_name: str, manifest_name: str) -> Verified:
    """verify_in after walking to directory from / (see open_dir)."""
    if IS_WINDOWS:  # NOTE: no uid/mode bits or dir fds; %LOCALAPPDATA% is per-user. Hash only.
        return _verify_by_path(Path(directory), lib_name, manifest_name)
    try:
        dir_fd = open_dir(directory)
    except FileNotFoundError:
        raise Damaged(f"{directory} is missing") from None
    try:
        return verify_in(dir_fd, os.path.abspath(directory), lib_name, manifest_name)
    finally:
        os.close(dir_fd)


def _verify_by_path(directory: Path, lib_name: str, manifest_name: str) -> Verified:
    try:
        expected = json.loads((directory / manifest_name).read_text()).get("sha256")
        fd = os.open(directory / lib_name, _FILE_FLAGS)
    except (OSError, ValueError, AttributeError) as exc:
        raise Damaged(f"{directory / lib_name} cannot be verified ({exc})") from None
    data, st = read_all(fd), os.fstat(fd)
    if sha256(data) != expected:
        os.close(fd)
        raise Damaged(f"{directory / lib_name} does not match the sha256 recorded when it was built", st)
    return Verified(fd, str(directory / lib_name), data, st)


# -- loading exactly the verified file -----------------------------------------------------------

_held: dict = {}  # (st_dev, st_ino) -> the descriptor whose /proc/self/fd name was dlopened


def dlopen(verified: Verified) -> ctypes.CDLL:
    """ctypes.CDLL of the verified file itself; Damaged when the dynamic loader refuses it."""
    try:
        return _dlopen(verified)
    except OSError as exc:  # ctypes names /proc/self/fd/N; say which file that was
        raise Damaged(f"{verified.shown} does not load ({str(exc).rpartition(': ')[2]})", verified.st) from exc


def _dlopen(verified: Verified) -> ctypes.CDLL:
    if IS_WINDOWS:
        os.close(verified.fd)
        return ctypes.CDLL(verified.shown)
    if not PROC_FD:
        os.close(verified.fd)
        return _dlopen_copy(verified.data)
    # NOTE: the dynamic loader also matches a new dlopen by name, so "/proc/self/fd/N" must never
    # name another file once loaded: the descriptor stays open for the life of the process.
    ident = (verified.st.st_dev, verified.st.st_ino)
    fd = _held.setdefault(ident, verified.fd)
    if fd != verified.fd:
        os.close(verified.fd)  # this very file is loaded already, through fd
    try:
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError:
        del _held[ident]
        os.close(fd)
        raise


def _dlopen_copy(data: bytes) -> ctypes.CDLL:
    """Load the verified bytes from a fresh 0700 directory (the name is never reused)."""
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="adambridge-load-"))
    try:
        os.chmod(tmp, 0o700)
        os.close(open_dir(tmp))  # Untrusted when TMPDIR lies where others can swap it
        path = os.path.join(tmp, "lib.so")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o700)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        return ctypes.CDLL(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the mapping outlives the file
