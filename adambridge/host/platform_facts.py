"""Platform facts: which operating-system calls this Python has, read once, and the one fallback for each it lacks.

Every call that only some systems have (positional I/O, file locks, preallocation, data
sync, uncached files, directory fsync, private anonymous maps, fork hooks) is reached through
here, so ``import adambridge`` works wherever torch does. ``facts()`` reads them once;
``facts_of(system)`` gives those of another system's CPython, which is how the tests run the
Windows and macOS fallbacks on Linux too (they monkeypatch ``facts``). What each system's
CPython has:

=====================  ==================  =====================  ===================
call                   Linux               macOS                  Windows
=====================  ==================  =====================  ===================
positional I/O         os.preadv/pwritev   os.preadv/pwritev      lseek + read/write,
                                                                  one lock per file
directory lock         fcntl.flock         fcntl.flock            msvcrt.locking
reserve file space     os.posix_fallocate  ftruncate (sparse)     ftruncate (sparse)
durable data           os.fdatasync        fcntl F_FULLFSYNC      os.fsync
uncached files         O_DIRECT            fcntl F_NOCACHE        none (buffered)
durable rename         fsync of the dir    fsync of the dir       MoveFileExW write-through
anonymous buffers      MAP_PRIVATE         MAP_PRIVATE            mmap(-1, n)
fork hooks             os.register_at_fork os.register_at_fork    none (no fork)
=====================  ==================  =====================  ===================

Standard library only.
"""
from __future__ import annotations

import errno
import functools
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

SYSTEMS = ("linux", "darwin", "windows")


@dataclass(frozen=True)
class Facts:
    """What this Python offers for each platform-specific call (see the module table)."""

    system: str            # "linux", "darwin", "windows", or sys.platform elsewhere
    positional_io: str     # "preadv" or "seek"
    lock: str              # "flock" or "msvcrt"
    preallocate: str       # "posix_fallocate" or "truncate"
    data_sync: str         # "fdatasync", "fullfsync" or "fsync"
    uncached: str          # "O_DIRECT", "F_NOCACHE" or "" (buffered only)
    directory_fsync: bool  # False: a rename is made durable by MoveFileExW write-through
    private_map: bool      # mmap.MAP_PRIVATE | MAP_ANONYMOUS (else a plain mmap(-1, n))
    fork: bool             # os.fork and os.register_at_fork exist
    binary: int            # os.O_BINARY where files have a text mode (Windows), else 0


def _system(platform: str) -> str:
    if platform.startswith("linux"):
        return "linux"
    return {"win32": "windows", "cygwin": "windows"}.get(platform, platform)


def _read_facts() -> Facts:
    """The facts of this very Python, each from the call's presence, not from the name."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    system = _system(sys.platform)
    if hasattr(os, "O_DIRECT"):
        uncached = "O_DIRECT"
    elif fcntl is not None and hasattr(fcntl, "F_NOCACHE"):
        uncached = "F_NOCACHE"
    else:
        uncached = ""
    fullfsync = fcntl is not None and hasattr(fcntl, "F_FULLFSYNC")
    return Facts(
        system=system,
        positional_io="preadv" if hasattr(os, "preadv") and hasattr(os, "pwritev") else "seek",
        lock="flock" if fcntl is not None and hasattr(fcntl, "flock") else "msvcrt",
        preallocate="posix_fallocate" if hasattr(os, "posix_fallocate") else "truncate",
        data_sync="fdatasync" if hasattr(os, "fdatasync") else "fullfsync" if fullfsync else "fsync",
        uncached=uncached,
        directory_fsync=system != "windows",
        private_map=hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"),
        fork=hasattr(os, "register_at_fork"),
        binary=getattr(os, "O_BINARY", 0))


@functools.lru_cache(maxsize=None)
def facts() -> Facts:
    """This Python's facts, read once."""
    return _read_facts()


def facts_of(system: str) -> Facts:
    """The facts of CPython 3.10+ on ``system`` ('linux', 'darwin' or 'windows'), for tests
    that run another system's fallbacks here."""
    if system == "linux":
        return Facts("linux", "preadv", "flock", "posix_fallocate", "fdatasync", "O_DIRECT",
                     True, True, True, 0)
    if system == "darwin":
        return Facts("darwin", "preadv", "flock", "truncate", "fullfsync", "F_NOCACHE",
                     True, True, True, 0)
    if system == "windows":
        return Facts("windows", "seek", "msvcrt", "truncate", "fsync", "", False, False, False,
                     getattr(os, "O_BINARY", 0))
    raise ValueError(f"Invalid system: {system!r} (expected one of {', '.join(SYSTEMS)})")


# -- positional I/O ------------------------------------------------------------------------------

_seek_locks: dict[int, threading.Lock] = {}
_seek_locks_guard = threading.Lock()


def _seek_lock(fd: int) -> threading.Lock:
    with _seek_locks_guard:
        return _seek_locks.setdefault(fd, threading.Lock())


def _pread_seek(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset``: lseek + read under the file's lock (the position
    is shared by every thread using fd). Returns the bytes read (fewer at end of file)."""
    got = 0
    with _seek_lock(fd):
        os.lseek(fd, offset, os.SEEK_SET)
        while got < len(view):
            chunk = os.read(fd, len(view) - got)
            if not chunk:
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
    return got


def _pwrite_seek(fd: int, data, offset: int) -> int:
    """Write ``data`` at ``offset``: lseek + write under the file's lock; bytes written."""
    view = memoryview(data).cast("B")
    put = 0
    with _seek_lock(fd):
        os.lseek(fd, offset, os.SEEK_SET)
        while put < len(view):
            wrote = os.write(fd, view[put:])
            if wrote <= 0:
                break
            put += wrote
    return put


def preadv(fd: int, buffers: list, offset: int) -> int:
    """os.preadv where it exists; elsewhere the same bytes through lseek + read."""
    if facts().positional_io == "preadv":
        return os.preadv(fd, buffers, offset)
    got = 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        n = _pread_seek(fd, view, offset + got)
        got += n
        if n < len(view):
            break
    return got


def pwritev(fd: int, buffers: list, offset: int) -> int:
    """os.pwritev where it exists; elsewhere the same bytes through lseek + write."""
    if facts().positional_io == "preadv":
        return os.pwritev(fd, buffers, offset)
    put = 0
    for buffer in buffers:
        n = _pwrite_seek(fd, buffer, offset + put)
        put += n
        if n < memoryview(buffer).nbytes:
            break
    return put


# -- files: open flags, reserving space, making data durable ------------------------------------

def open_flags(uncached: bool = False) -> int:
    """os.open flags for a state file: read-write, created, binary, O_DIRECT when asked and
    the system has it."""
    flags = os.O_RDWR | os.O_CREAT | facts().binary
    if uncached and facts().uncached == "O_DIRECT":
        flags |= os.O_DIRECT
    return flags


def set_uncached(fd: int) -> bool:
    """Turn off the page cache for an open file where that is a call after open (macOS
    F_NOCACHE); True when it is now uncached. O_DIRECT is an open flag instead."""
    if facts().uncached != "F_NOCACHE":
        return False
    import fcntl
    command = getattr(fcntl, "F_NOCACHE", None)
    if command is None:
        return False
    try:
        fcntl.fcntl(fd, command, 1)
    except OSError:
        return False
    return True


def reserve(fd: int, nbytes: int) -> None:
    """Make the file at least ``nbytes`` long, with the space reserved where the system can.

    NOTE: without posix_fallocate (macOS, Windows) the file is extended sparse: a full drive
    then fails the first write to a page rather than the tier's creation. That write is part
    of a step that commits nothing until every page is written and synced, so the error still
    leaves the committed state as it was; it only comes one step later."""
    if facts().preallocate == "posix_fallocate":
        os.posix_fallocate(fd, 0, nbytes)
    elif os.fstat(fd).st_size < nbytes:
        os.ftruncate(fd, nbytes)


def data_sync(fd: int) -> None:
    """Make the file's data durable: fdatasync; F_FULLFSYNC on macOS (its fsync leaves the
    data in the drive's cache), then fsync where the filesystem refuses that; else fsync."""
    how = facts().data_sync
    if how == "fdatasync":
        os.fdatasync(fd)
        return
    if how == "fullfsync" and _full_fsync(fd):
        return
    os.fsync(fd)


def _full_fsync(fd: int) -> bool:
    import fcntl
    command = getattr(fcntl, "F_FULLFSYNC", None)
    if command is None:
        return False
    try:
        fcntl.fcntl(fd, command)
    except OSError:  # a filesystem without it (SMB, some FUSE mounts): a plain fsync
        return False
    return True


def sync_directory(path: os.PathLike | str) -> None:
    """Make the renames in directory ``path`` durable (a no-op where renames are made durable
    by ``replace`` itself: Windows has no directory descriptors)."""
    if not facts().directory_fsync:
        return
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        if facts().data_sync == "fullfsync" and _full_fsync(dir_fd):
            return
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _move_file_write_through(source: str, target: str) -> None:
    import ctypes
    from ctypes import wintypes
    move = ctypes.WinDLL("kernel32", use_last_error=True).MoveFileExW
    move.argtypes = (wintypes.LPCWSTR, wintypes.LPCWSTR, wintypes.DWORD)
    move.restype = wintypes.BOOL
    # MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH: returns once the move is on disk.
    if not move(source, target, 0x1 | 0x8):
        raise ctypes.WinError(ctypes.get_last_error())


# (module-level so that tests can stand in for the Win32 call)
_move_durably: Callable[[str, str], None] = _move_file_write_through


def replace(source: os.PathLike | str, target: os.PathLike | str) -> None:
    """os.replace; where directories cannot be fsynced (Windows), a rename that is durable
    when this returns (MoveFileExW with MOVEFILE_WRITE_THROUGH)."""
    if facts().directory_fsync:
        os.replace(source, target)
    else:
        _move_durably(os.fspath(source), os.fspath(target))


# -- the directory lock ---------------------------------------------------------------------------

# NOTE: Windows locks are mandatory: a locked byte cannot be read through another handle, so
# the lock sits far past the token the lock file holds (locking past the end is allowed).
_MSVCRT_LOCK_OFFSET = 1 << 30


def try_lock(fd: int) -> bool:
    """Take the exclusive lock of an open lock file without waiting: True when taken, False
    when another holder has it; OSError when the filesystem cannot lock at all. Closing fd
    releases it."""
    if facts().lock == "flock":
        import fcntl
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True
    msvcrt = _msvcrt()
    os.lseek(fd, _MSVCRT_LOCK_OFFSET, os.SEEK_SET)
    try:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as exc:
        # NOTE: the C runtime says "locked by someone else" with EACCES (EDEADLOCK after its
        # retries); wine 8.0's says it with errno 0. Either way the directory is refused.
        if exc.errno in (errno.EACCES, errno.EDEADLK, 0):
            return False
        raise
    return True


def _msvcrt():
    import msvcrt
    return msvcrt


# -- memory and processes ---------------------------------------------------------------------------

def anonymous_map(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, page-aligned. (On Linux ``mmap.mmap(-1, n)`` alone would be
    MAP_SHARED shmem, which transparent huge pages leave out; Windows has only that form.)"""
    if facts().private_map:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def at_fork_in_child(fn: Callable[[], None]) -> None:
    """Run fn in every forked child (nothing where there is no fork)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=fn)


def describe() -> str:
    """One line for ``python -m adambridge info``."""
    f = facts()
    return (f"{f.system}: positional I/O by {f.positional_io}, locks by {f.lock}, space by "
            f"{f.preallocate}, durability by {f.data_sync}, uncached files by "
            f"{f.uncached or 'none (buffered)'}")

