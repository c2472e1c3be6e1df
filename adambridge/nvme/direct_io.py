"""Direct file I/O for the NVMe tier: 4096-aligned reused buffers, O_DIRECT files, the engines.

Each read or write is one whole page record into or out of an aligned buffer. Two engines
move them, chosen per tier by nvme/engine.py: io_uring (nvme/uring.py: no thread per request,
completions reaped by the thread that waits) where the kernel allows it, and here a pool of
``queue_depth`` threads doing ``os.preadv``/``os.pwritev`` (both release the GIL) where it
does not. Both give the same results and the same one-line errors (``check_transfer``).
Where a filesystem refuses O_DIRECT (EINVAL at open) the file falls back to buffered I/O,
with one warning per directory. Every call that only some systems have (O_DIRECT, flock,
posix_fallocate, fdatasync, preadv) goes through host/platform_facts.py, which has the fallback.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..host import platform_facts
from ..host.alloc import HUGE_PAGE, advise_huge_pages

ALIGN = 4096  # O_DIRECT needs buffer address, file offset and length aligned to the block size
_log = logging.getLogger("adambridge")
_warned_dirs: set[str] = set()


class TierError(RuntimeError):
    """An I/O failure of the NVMe tier; the message names the file and the fix."""


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


_HUGE_BUFFER = 256 << 10  # smaller buffers (tests' tiny pages) stay on plain pages


def _huge_page_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """(a private anonymous mapping, the offset in it where ``nbytes`` start).

    Buffers of 256 KiB or more (every page record of the default page size: 1.5 MiB with fp8
    moments, 3 MiB with fp32) start on a 2 MiB boundary, span whole huge pages and are
    advised to be transparent huge pages: the block layer turns every physically contiguous
    run of a buffer into one DMA segment, and on this project's virtio disk an O_DIRECT
    record from a buffer of 768 scattered 4 KiB pages moved ~1.5x slower than from two huge
    pages (~1.1x with 250 runs). Where the kernel has no huge page to give, the buffer is
    ordinary 4 KiB pages: slower, the same bytes (platform_facts.anonymous_map)."""
    if nbytes < _HUGE_BUFFER:
        return platform_facts.anonymous_map(nbytes), 0
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    whole = platform_facts.anonymous_map(span + HUGE_PAGE)  # the slack lets it start aligned
    memory = torch.frombuffer(whole, dtype=torch.uint8)
    start = -memory.data_ptr() % HUGE_PAGE
    advise_huge_pages(memory[start:start + span], min_bytes=HUGE_PAGE)
    return whole, start


class AlignedBuffer:
    """Page-aligned anonymous memory (so O_DIRECT-safe; on huge pages where it can be),
    seen as bytes and as a uint8 tensor."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(nbytes)
        # What the buffer holds in RAM once written: on huge pages, whole 2 MiB pages.
        self.resident_bytes = self.nbytes if self.nbytes < _HUGE_BUFFER else \
            -(-self.nbytes // HUGE_PAGE) * HUGE_PAGE
        self._map, start = _huge_page_map(self.nbytes)
        self.memory = memoryview(self._map)[start:start + self.nbytes]
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[start:start + self.nbytes]
        self._views: dict = {}

    def cached_views(self, key: object, make: Callable[["AlignedBuffer"], dict]) -> dict:
        """Views made once per layout: a page's tensors are then one slice each, not three ops."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = make(self)
        return views

    def view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of ``dtype`` starting ``offset`` bytes in."""
        return self.tensor[offset:offset + count * dtype.itemsize].view(dtype)


def _fix_for(err: int) -> str:
    if err == errno.ENOSPC:
        return "free space on that drive or pass a larger offload_dir"
    if err in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "pass a writable offload_dir"
    if err == errno.ENOENT:
        return "the directory was removed; restore it or pass another offload_dir"
    return "check the drive (dmesg) and resume from a checkpoint"


def describe_os_error(action: str, path: object, exc: OSError) -> str:
    """One line: what failed, on which file, why, and what to do."""
    reason = exc.strerror or str(exc)
    return f"NVMe tier: {action} {path} failed ({reason}); {_fix_for(exc.errno or 0)}"


class DataFile:
    """One state file, opened O_DIRECT where the filesystem allows, with space reserved."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.fd, self.direct = _open(path)
        try:
            # Reserve the space now, so a full drive fails the first step, not a later one.
            platform_facts.reserve(self.fd, nbytes)
        except OSError as exc:
            os.close(self.fd)
            raise TierError(describe_os_error(f"reserving {nbytes} bytes for", path, exc)) from None

    def check_size(self) -> None:
        """Raise if something outside us truncated the file (its state is then gone)."""
        size = os.fstat(self.fd).st_size
        if size < self.nbytes:
            raise TierError(f"NVMe tier: {self.path} is {size} bytes, expected {self.nbytes}: it "
                            f"was truncated outside adambridge; restore the optimizer from a "
                            f"checkpoint with opt.load_state_dict()")

    def sync(self) -> None:
        # NOTE: O_DIRECT bypasses the page cache, not the drive's write cache: fdatasync is
        # what makes the new pages durable before the manifest names them.
        try:
            platform_facts.data_sync(self.fd)
        except OSError as exc:
            raise TierError(describe_os_error("syncing", self.path, exc)) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ReadOnlyFile:
    """A state file opened for reading with buffered I/O (recovery needs no O_DIRECT)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path, self.nbytes, self.direct = path, nbytes, False
        self.fd = os.open(path, os.O_RDONLY | platform_facts.facts().binary)

    check_size = DataFile.check_size
    close = DataFile.close


def _open(path: Path) -> tuple[int, bool]:
    flags = platform_facts.open_flags()
    direct = platform_facts.open_flags(uncached=True)
    try:
        fd = os.open(path, direct, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL or direct == flags:
            raise TierError(describe_os_error("opening", path, exc)) from None
    else:
        return fd, direct != flags or platform_facts.set_uncached(fd)
    directory = str(path.parent)
    if directory not in _warned_dirs:
        _warned_dirs.add(directory)
        _log.warning("adambridge NVMe tier: the filesystem of %s refuses O_DIRECT; using buffered "
                     "I/O there (the page cache will hold a second copy of the state)", directory)
    try:
        return os.open(path, flags, 0o600), False
    except OSError as exc:
        raise TierError(describe_os_error("opening", path, exc)) from None


# The two system calls, module-level so tests can inject faults (EIO, ENOSPC, short reads).
_preadv: Callable[[int, list, int], int] = platform_facts.preadv
_pwritev: Callable[[int, list, int], int] = platform_facts.pwritev


LOCK_FILE = "adambridge.lock"


def lock_directory(directory: Path) -> int:
    """An exclusive lock, so two optimizers never share a directory's files; also proves
    the directory writable at construction rather than at the first step."""
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, platform_facts.open_flags(), 0o600)
    except OSError as exc:
        raise ValueError(describe_os_error("creating", path, exc)) from None
    try:
        locked = platform_facts.try_lock(fd)
    except OSError as exc:
        os.close(fd)
        # A filesystem without locks (some network mounts) cannot keep two optimizers,
        # or two nodes, apart: refuse it rather than share the files unguarded.
        raise ValueError(f"offload_dir {str(directory)!r} cannot be locked "
                         f"({platform_facts.facts().lock}: {exc.strerror or exc}); use a "
                         f"directory on a local drive, one per optimizer") from None
    if not locked:
        os.close(fd)
        raise ValueError(f"offload_dir {str(directory)!r} is in use by another optimizer; "
                         f"give each optimizer its own directory{_per_rank_hint(directory)}, "
                         f"or let the other go first (opt.nvme_tier.close() on the old "
                         f"optimizer, e.g. a Trainer's before resuming in the same "
                         f"process)") from None
    _held_locks.add(fd)
    return fd


# Lock descriptors held in this process. A forked child (a DataLoader worker) closes its
# copies at once: an flock belongs to the open file, so while any child still held a copy
# the directory would stay locked after the optimizer let it go.
_held_locks: set = set()


def release_lock(fd: int) -> None:
    """Close a descriptor from lock_directory (not again in a child that dropped it)."""
    if fd in _held_locks:
        _held_locks.discard(fd)
        os.close(fd)


def _drop_inherited_locks() -> None:
    for fd in _held_locks:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_locks.clear()


platform_facts.at_fork_in_child(_drop_inherited_locks)


def claim_directory(directory: Path, fd: int) -> bytes:
    """Write this optimizer's token into the locked file ``fd`` and return it: the lock
    keeps out optimizers on this machine, the token (check_claim) those whose lock never
    saw it, on a network filesystem that locks per machine."""
    token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(8)}\n".encode()
    try:
        os.ftruncate(fd, 0)
        platform_facts.pwritev(fd, [token], 0)
    except OSError as exc:
        raise ValueError(describe_os_error("writing", directory / LOCK_FILE, exc)) from None
    return token


def check_claim(directory: Path, token: bytes) -> None:
    """Raise, before a commit writes anything, if another optimizer has claimed the
    directory since this one did. Reopened each time: an NFS client reads a file afresh at
    open, not through an open descriptor."""
    path = directory / LOCK_FILE
    try:
        with open(path, "rb") as file:
            found = file.read(len(token) + 256)
    except FileNotFoundError:
        return  # no one claimed it since (a claim writes this file); the step says what broke
    except OSError as exc:
        raise TierError(describe_os_error("reading", path, exc)) from None
    if found != token:
        other = " ".join(found.decode(errors="replace").split()) or "its token being written"
        raise TierError(f"NVMe tier: offload_dir {str(directory)!r} was taken by another "
                        f"optimizer ({other}) whose lock did not see this one (a network "
                        f"filesystem that locks per machine); give each optimizer its own "
                        f"directory{_per_rank_hint(directory)}")


def _per_rank_hint(directory: Path) -> str:
    """Under torch.distributed the usual cause is every rank given one path: name the fix."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ""
    per_rank = str(directory / f"rank{dist.get_rank()}")
    return f" (one per rank under torch.distributed, e.g. {per_rank!r})"


class IOCounters:
    """Bytes moved and time the streaming loop waited for I/O, since the last take()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0
        self.total_written = 0  # the endurance cost, never reset

    def add(self, read: int = 0, written: int = 0, wait_s: float = 0.0) -> None:
        with self.lock:
            self.read_bytes += read
            self.write_bytes += written
            self.total_written += written
            self.wait_s += wait_s

    def take(self) -> tuple[int, int, float]:
        with self.lock:
            taken = (self.read_bytes, self.write_bytes, self.wait_s)
            self.read_bytes = self.write_bytes = 0
            self.wait_s = 0.0
            return taken


class IOEngine:
    """What both engines share: the counters, helper threads for non-I/O work (a fresh page,
    an fsync), and waiting. ``read``/``write`` return a request with ``done()``/``result()``
    (a Future, or an io_uring request) whose ``result()`` raises the TierError."""

    name = ""

    def __init__(self, queue_depth: int, helpers: int) -> None:
        self.queue_depth = queue_depth
        self.counters = IOCounters()
        self.fallback_reason = ""  # why io_uring was not used, when it was asked for by 'auto'
        self._pool = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="adambridge-io")

    def describe(self) -> str:
        """One line for placement and info: which engine moves the pages, and why."""
        if self.name == "io_uring":
            return "io_uring"
        why = f" (io_uring unavailable: {self.fallback_reason})" if self.fallback_reason else ""
        return f"a pool of pread/pwrite threads{why}"

    def register(self, buffers: list) -> None:
        """The buffers every request will use (the page ring): io_uring pins them once; the
        thread pool has nothing to do."""

    def call(self, fn: Callable[[], None]) -> Future:
        return self._pool.submit(fn)

    def wait(self, future: Optional[Any]) -> None:
        """Block on one request, counting the time as I/O wait; re-raise its error."""
        if future is None:
            return
        if not future.done():
            began = time.perf_counter()
            future.result()
            self.counters.add(wait_s=time.perf_counter() - began)
        else:
            future.result()

    def wait_any(self, first: Any, others: list) -> None:
        """Block until ``first`` or any of ``others`` is done (counted as I/O wait); raises
        nothing (each request's own wait does)."""
        began = time.perf_counter()
        self._wait_any(first, others)
        self.counters.add(wait_s=time.perf_counter() - began)

    def _wait_any(self, first: Any, others: list) -> None:
        wait_futures([first, *others], return_when=FIRST_COMPLETED)

    def drain(self, futures: list) -> Optional[BaseException]:
        """Wait for every request (so no buffer is still in use); return the first error."""
        first = None
        for future in futures:
            if future is None:
                continue
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the caller raises the first one
                first = first or exc
        return first

    def close(self, join: bool = True) -> None:
        """Stop the helper threads; ``join=False`` lets them finish their queue and exit on
        their own (what the tier's finalizer needs, see nvme._close)."""
        # A pool thread that drops the last reference to the tier must not join itself.
        inside = threading.current_thread().name.startswith("adambridge-io")
        self._pool.shutdown(wait=join and not inside)


def transfer_error(kind: str, file: DataFile, exc: OSError) -> TierError:
    """The TierError of a failed read or write (``kind``: 'reading' or 'writing')."""
    return TierError(describe_os_error(kind, file.path, exc))


def check_transfer(kind: str, file: DataFile, offset: int, nbytes: int, moved: int) -> None:
    """Raise the one-line TierError when a read or write moved fewer than ``nbytes``."""
    if moved == nbytes:
        return
    if kind == "reading":
        raise TierError(f"NVMe tier: reading {file.path} at byte {offset} returned {moved} of "
                        f"{nbytes} bytes: it was truncated outside adambridge; restore the "
                        f"optimizer from a checkpoint with opt.load_state_dict()")
    # A short write is how some filesystems report a full disk.
    raise transfer_error(kind, file, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))


class IOPool(IOEngine):
    """``queue_depth`` threads running whole-record reads and writes; futures for each."""

    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth, helpers=queue_depth)

    def read(self, file: DataFile, buffer: AlignedBuffer, offset: int, nbytes: int) -> Future:
        return self._pool.submit(self._read, file, buffer, offset, nbytes)

    def write(self, file: DataFile, buffer: AlignedBuffer, offset: int, nbytes: int) -> Future:
        return self._pool.submit(self._write, file, buffer, offset, nbytes)

    def _read(self, file: DataFile, buffer: AlignedBuffer, offset: int, nbytes: int) -> None:
        try:
            got = _preadv(file.fd, [buffer.memory[:nbytes]], offset)
        except OSError as exc:
            raise transfer_error("reading", file, exc) from None
        check_transfer("reading", file, offset, nbytes, got)
        self.counters.add(read=nbytes)

    def _write(self, file: DataFile, buffer: AlignedBuffer, offset: int, nbytes: int) -> None:
        try:
            put = _pwritev(file.fd, [buffer.memory[:nbytes]], offset)
        except OSError as exc:
            raise transfer_error("writing", file, exc) from None
        check_transfer("writing", file, offset, nbytes, put)
        self.counters.add(written=nbytes)


def describe_direct_io(directory: str, engine: str) -> str:
    """One line for ``python -m adambridge info``: does O_DIRECT work in ``directory``, and
    which engine (``engine``, an IOEngine.describe()) would move the pages?"""
    path = Path(directory) / f".adambridge-probe-{os.getpid()}"
    uncached = platform_facts.facts().uncached
    try:
        fd = os.open(path, platform_facts.open_flags(uncached=True), 0o600)
    except OSError as exc:
        return f"O_DIRECT refused in {directory} ({exc.strerror}): an offload_dir there is buffered"
    try:
        buffer = AlignedBuffer(ALIGN)
        platform_facts.set_uncached(fd)
        platform_facts.pwritev(fd, [buffer.memory], 0)
        platform_facts.preadv(fd, [buffer.memory], 0)
    except OSError as exc:
        return f"{uncached or 'file'} I/O fails in {directory} ({exc.strerror}): pass another offload_dir"
    finally:
        os.close(fd)
        path.unlink()
    works = "O_DIRECT works" if uncached == "O_DIRECT" else \
        f"no O_DIRECT on {platform_facts.facts().system}; " + \
        ("F_NOCACHE files work" if uncached else "buffered files work")
    return f"{works} in {directory} (offload_dir=...; I/O by {engine}; opt.placement() shows what goes there)"
