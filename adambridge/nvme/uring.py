"""The io_uring engine of the NVMe tier: whole page records through one ring, no I/O threads.

Requests go to csrc/uring.c (raw io_uring_setup/io_uring_enter, mmap'd rings) and complete in
the kernel; the thread that waits for one reaps every completion that is ready, so no Python
thread exists per request. Reads and writes of O_DIRECT files on ext4/xfs are truly
asynchronous there, which leaves both cores to the update kernel. Results are checked by the
same ``check_transfer`` as the thread pool's, so every error reads the same.
"""
from __future__ import annotations

import ctypes
import os
import threading
from ctypes import POINTER, c_int, c_int32, c_uint32, c_uint64, c_void_p
from typing import Any, Callable, Optional

from .direct_io import AlignedBuffer, DataFile, IOEngine, TierError, check_transfer, transfer_error

AB_URING_READ, AB_URING_WRITE = 0, 1
_KINDS = {AB_URING_READ: "reading", AB_URING_WRITE: "writing"}
_EBUSY = 16
_REAP_BATCH = 64

_PROTOTYPES = {
    "ab_uring_open": (c_int, (c_uint32, POINTER(c_void_p))),
    "ab_uring_close": (None, (c_void_p,)),
    "ab_uring_register_buffers": (c_int, (c_void_p, POINTER(c_void_p), POINTER(c_uint64), c_int)),
    "ab_uring_submit": (c_int, (c_void_p, c_int, c_int, c_void_p, c_uint32, c_uint64, c_int,
                                c_uint64)),
    "ab_uring_reap": (c_int, (c_void_p, c_int, POINTER(c_uint64), POINTER(c_int32), c_int)),
}


def _passed(kind: str, fd: int, offset: int, result: int) -> int:
    return result


# Every completion's result (bytes moved or -errno) passes through here, module-level so tests
# inject faults into this engine as they do into nvme_io._preadv/_pwritev for the pool.
_completed: Callable[[str, int, int, int], int] = _passed


def uring_library() -> tuple[Optional[ctypes.CDLL], str]:
    """(the native library with the io_uring prototypes set, "") or (None, why not)."""
    from .._native import loader  # the kernel's library; uring.c is one of its sources
    if loader.native_disabled():
        return None, "the native library is disabled by ADAMBRIDGE_DISABLE_NATIVE"
    try:
        lib = loader.load().lib
    except Exception as exc:  # noqa: BLE001 - any reason to lack the library means the pool
        return None, f"the native library is unavailable ({str(exc).split('.')[0]})"
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"the native library lacks {name} (delete the build cache and retry)"
        fn.restype, fn.argtypes = restype, argtypes
    return lib, ""


def open_ring(lib: ctypes.CDLL, entries: int) -> tuple[Optional[int], str]:
    """(a ring handle, "") or (None, why io_uring_setup refused)."""
    ring = c_void_p()
    status = lib.ab_uring_open(entries, ctypes.byref(ring))
    if status == 0:
        return ring.value, ""
    err = -status
    if err == 38:  # ENOSYS
        return None, "io_uring_setup is not supported by this kernel or this build"
    if err == 1:   # EPERM
        return None, ("io_uring_setup refused (EPERM: kernel.io_uring_disabled or a seccomp "
                      "filter, as in many containers)")
    return None, f"io_uring_setup failed ({os.strerror(err)})"


class UringRequest:
    """One submitted read or write; ``result()`` waits for it and raises its TierError."""

    __slots__ = ("engine", "op", "file", "offset", "nbytes", "res")

    def __init__(self, engine: "UringEngine", op: int, file: DataFile, offset: int,
                 nbytes: int) -> None:
        self.engine, self.op, self.file, self.offset, self.nbytes = engine, op, file, offset, nbytes
        self.res: Optional[int] = None

    def done(self) -> bool:
        if self.res is None:
            self.engine.poll()
        return self.res is not None

    def result(self) -> None:
        if self.res is None:
            self.engine.wait_for(self)
        kind = _KINDS[self.op]
        if self.res < 0:
            err = -self.res
            raise transfer_error(kind, self.file, OSError(err, os.strerror(err)))
        check_transfer(kind, self.file, self.offset, self.nbytes, self.res)


class UringEngine(IOEngine):
    """Reads and writes through one io_uring; four helper threads only for non-I/O work (a
    fresh page, the fsyncs of a commit, which run side by side)."""

    name = "io_uring"

    def __init__(self, queue_depth: int, lib: ctypes.CDLL, ring: int) -> None:
        super().__init__(queue_depth, helpers=4)
        self._lib, self._ring = lib, ring
        self._lock = threading.Lock()  # the ring is single-threaded (uring.c)
        self._in_flight: dict[int, UringRequest] = {}
        self._next_tag = 1
        self._tags = (c_uint64 * _REAP_BATCH)()
        self._results = (c_int32 * _REAP_BATCH)()
        self._registered: dict[int, int] = {}  # buffer address -> its registered index
        self.unregistered_reason = ""
        # NOTE: a forked child shares the ring itself (the same CQ), not a copy: reaping
        # there would steal the parent's completions, so the child never touches it.
        self._pid = os.getpid()

    def describe(self) -> str:
        if self.unregistered_reason:
            return f"io_uring (buffers not registered: {self.unregistered_reason})"
        return "io_uring"

    def register(self, buffers: list) -> None:
        """Pin the ring's buffers once (READ_FIXED/WRITE_FIXED then skip pinning the pages of
        every request). Where the kernel refuses (RLIMIT_MEMLOCK: ENOMEM) requests stay plain
        reads and writes, which is slower but the same bytes; describe() says why."""
        addrs = (c_void_p * len(buffers))(*[b.tensor.data_ptr() for b in buffers])
        lens = (c_uint64 * len(buffers))(*[b.nbytes for b in buffers])
        with self._lock:
            while self._in_flight:  # registration needs an idle ring
                self._reap(1)
            status = self._lib.ab_uring_register_buffers(self._ring, addrs, lens, len(buffers))
            if status < 0:
                self._registered = {}
                self.unregistered_reason = os.strerror(-status)
            else:
                self._registered = {b.tensor.data_ptr(): i for i, b in enumerate(buffers)}
                self.unregistered_reason = ""

    def read(self, file: DataFile, buffer: AlignedBuffer, offset: int,
             nbytes: int) -> UringRequest:
        return self._submit(AB_URING_READ, file, buffer, offset, nbytes)

    def write(self, file: DataFile, buffer: AlignedBuffer, offset: int,
              nbytes: int) -> UringRequest:
        return self._submit(AB_URING_WRITE, file, buffer, offset, nbytes)

    def _submit(self, op: int, file: DataFile, buffer: AlignedBuffer, offset: int,
                nbytes: int) -> UringRequest:
        if os.getpid() != self._pid:
            raise TierError("NVMe tier: this optimizer's io_uring belongs to the process that "
                            "made it, not to this forked child; build the optimizer in the child "
                            "or pass OffloadConfig(io_engine='threads')")
        request = UringRequest(self, op, file, offset, nbytes)
        address = buffer.tensor.data_ptr()
        with self._lock:
            tag, self._next_tag = self._next_tag, self._next_tag + 1
            index = self._registered.get(address, -1)
            while True:
                status = self._lib.ab_uring_submit(self._ring, op, file.fd, address, nbytes,
                                                   offset, index, tag)
                if status != -_EBUSY or not self._in_flight:
                    break
                self._reap(1)  # the queue is full: make room
            if status < 0:
                request.res = status  # raised by result(), where the pool raises too
            else:
                self._in_flight[tag] = request
        return request

    def poll(self) -> None:
        """Reap what has completed, without waiting (skipped while another thread reaps)."""
        if self._lock.acquire(blocking=False):
            try:
                self._reap(0)
            finally:
                self._lock.release()

    def _wait_any(self, first: Any, others: list) -> None:
        if not isinstance(first, UringRequest):  # a fresh page, made by a helper thread
            first.exception()  # waits; its own wait raises
            return
        with self._lock:  # one completion of this ring, whichever it is
            if first.res is None and all(r.res is None for r in others):
                self._reap(1)

    def wait_for(self, request: UringRequest) -> None:
        while request.res is None:
            with self._lock:
                if request.res is None:
                    self._reap(1)

    def _reap(self, min_complete: int) -> None:
        count = self._lib.ab_uring_reap(self._ring, min_complete, self._tags, self._results,
                                        _REAP_BATCH)
        if count < 0:
            raise TierError(f"NVMe tier: io_uring_enter failed ({os.strerror(-count)}); pass "
                            f"OffloadConfig(io_engine='threads') and resume from a checkpoint")
        for i in range(count):
            request = self._in_flight.pop(self._tags[i])
            res = _completed(_KINDS[request.op], request.file.fd, request.offset, self._results[i])
            request.res = res
            if res == request.nbytes:
                moved = dict(read=res) if request.op == AB_URING_READ else dict(written=res)
                self.counters.add(**moved)

    def close(self, join: bool = True) -> None:
        if os.getpid() != self._pid:  # a forked child: the parent's ring, not ours to drain
            super().close(join)
            return
        with self._lock:
            while self._in_flight:  # the kernel may still be writing into a buffer
                self._reap(1)
            if self._ring:
                self._lib.ab_uring_close(self._ring)
                self._ring = None
        super().close(join)
