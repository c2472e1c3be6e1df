"""Exact-size page-locked host buffers for the device<->host copies of asynchronous mode.

NOTE: torch's pinned allocator (``pin_memory=True``) rounds every request up to a power of
two, so a 272 MB gradient buffer locks 512 MB. From ``REGISTER_MIN_BYTES`` up we allocate an
ordinary host tensor and lock exactly its pages with ``cudaHostRegister``; smaller buffers
use ``pin_memory`` (the rounding costs little there). Without CUDA a buffer is a plain tensor:
the host transport never copies, so nothing needs locking.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import Any, Callable, Optional

import torch

from .alloc import host_empty

REGISTER_MIN_BYTES = 1 << 20
# cudaHostRegisterPortable: pinned for every CUDA context, so any device's streams may use it.
_REGISTER_PORTABLE = 1

_PAGE = mmap.PAGESIZE

_log = logging.getLogger("adambridge")


def _cudart() -> Any:
    """The CUDA runtime bindings (a function so tests can substitute a fake)."""
    return torch.cuda.cudart()


def _cuda_available() -> bool:
    return torch.cuda.is_available()


_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def _loaded_get_last_error() -> Optional[Callable[[], int]]:
    """cudaGetLastError of the libcudart torch has already loaded (None if none is found).

    RTLD_NOLOAD: only a library already in the process, so the error state we clear is the
    one torch's kernel launches read (a second copy of the runtime has its own state).
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_GLOBAL", 0)
    for name in _CUDART_NAMES:
        try:
            return ctypes.CDLL(name, mode=mode).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None


def clear_cuda_error() -> int:
    """Reset this thread's sticky-until-read CUDA runtime error; returns what it was.

    NOTE: A failed cudaHostRegister leaves its error set on the calling
    thread, and torch's next kernel launch on that thread raises it (from inside
    loss.backward()) as if the kernel had failed. torch.cuda.cudart() binds no
    cudaGetLastError in most versions, hence the ctypes fallback.
    """
    cudart = _cudart()
    get_last_error = getattr(cudart, "cudaGetLastError", None) or _loaded_get_last_error()
    if get_last_error is None:
        _log.warning("adambridge: found no cudaGetLastError to clear a failed "
                     "cudaHostRegister; the next CUDA call on this thread may report it")
        return -1
    return int(get_last_error())


def _unregister(cudart_fn: Callable[[], Any], address: int, tensor: torch.Tensor) -> None:
    # ``tensor`` is an argument only so that the memory outlives its registration: the
    # finalizer holds it until cudaHostUnregister has returned.
    status = int(cudart_fn().cudaHostUnregister(address))
    if status != 0:
        _log.warning("cudaHostUnregister(0x%x) failed with cudaError %d; the pages stay locked "
                     "until the process exits", address, status)
    del tensor


def _page_aligned(nbytes: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(a tensor of ``nbytes`` starting on a page, the bytes of its whole pages).

    NOTE: registering a range that shares a page with an earlier registration fails
    (cudaErrorHostMemoryAlreadyRegistered), and malloc packs 1-4 MiB blocks next to each
    other; so each registered buffer owns its pages (at most two spare pages per buffer).
    """
    locked = -(-nbytes // _PAGE) * _PAGE
    raw = host_empty(locked + _PAGE, torch.uint8)
    offset = (-raw.data_ptr()) % _PAGE
    return raw[offset:offset + nbytes].view(dtype), locked


class PinnedBuffer:
    """One flat host tensor of exactly ``numel`` elements, page-locked while the buffer lives.

    ``tensor`` is the memory. ``close()`` (or garbage collection of this object) unregisters
    it before the memory can be freed; views that outlive the buffer are still valid memory,
    only no longer page-locked. ``kind`` says how it was made: 'registered' (cudaHostRegister),
    'pin_memory' or 'pageable' (no CUDA).
    """

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.nbytes = nbytes
        self._finalizer: Optional[weakref.finalize] = None
        if not _cuda_available():
            self.kind = "pageable"
            self.tensor = host_empty(numel, dtype)
        elif nbytes < REGISTER_MIN_BYTES:
            self.kind = "pin_memory"
            self.tensor = torch.empty(numel, dtype=dtype, pin_memory=True)
        else:
            self.kind = "registered"
            self.tensor, self.locked_bytes = _page_aligned(nbytes, dtype)
            self._register()

    def _register(self) -> None:
        address = self.tensor.data_ptr()
        status = int(_cudart().cudaHostRegister(address, self.locked_bytes, _REGISTER_PORTABLE))
        if status != 0:
            clear_cuda_error()  # else torch's next launch on this thread raises it
            raise RuntimeError(f"cudaHostRegister of a {self.nbytes}-byte buffer failed with "
                               f"cudaError {status}; the host may be out of lockable memory "
                               f"(check `ulimit -l`), or an earlier CUDA error is pending")
        self._finalizer = weakref.finalize(self, _unregister, _cudart, address, self.tensor)
        # At interpreter exit the OS reclaims everything; calling into CUDA then can crash.
        self._finalizer.atexit = False
        _LIVE.add(self)

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    @property
    def usable(self) -> bool:
        """False in a child forked after this buffer was pinned (see ``_after_fork_in_child``)."""
        return not getattr(self, "_forked", False)

    def check_usable(self) -> None:
        if not self.usable:
            raise RuntimeError("adambridge: this process was forked after the optimizer pinned "
                               "its staging buffers; CUDA cannot be used in a forked child. "
                               "Use the optimizer in the parent only (DataLoader workers "
                               "never need it), or start children with the 'spawn' method")

    def close(self) -> None:
        """Unlock the pages now (idempotent). Call only when no copy uses the buffer."""
        if self._finalizer is not None:
            self._finalizer()


# Every buffer registered with CUDA in this process (weakly: the set never keeps one alive).
_LIVE: "weakref.WeakSet[PinnedBuffer]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """NOTE: A fork (DataLoader workers) copies the parent's registered
    pages copy-on-write into the child, where CUDA is unusable. The child must never call
    cudaHostUnregister on them (that is the parent's registration) nor copy through them."""
    buffers = list(_LIVE)
    for buffer in buffers:
        buffer._forked = True
        if buffer._finalizer is not None:
            buffer._finalizer.detach()  # the parent unregisters; the child only drops memory
    _LIVE.clear()
    if buffers:
        _log.warning("adambridge: forked after pinning %d staging buffers (%d bytes); the "
                     "child cannot use them. Start workers before attach_hooks(), or use "
                     "multiprocessing's 'spawn' or 'forkserver' start method",
                     len(buffers), sum(b.nbytes for b in buffers))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def live_registered_bytes() -> int:
    """Bytes page-locked with cudaHostRegister by this process's live buffers."""
    return sum(buffer.nbytes for buffer in list(_LIVE) if buffer.registered)


def pinned_empty(numel: int, dtype: torch.dtype) -> PinnedBuffer:
    """An uninitialised exact-size page-locked buffer (plain host memory without CUDA)."""
    return PinnedBuffer(numel, dtype)
