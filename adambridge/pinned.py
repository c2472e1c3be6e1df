"""Exact-size page-locked host buffers for the device<->host copies of asynchronous mode.

NOTE: torch's pinned allocator (``pin_memory=True``) rounds every request up to a power of
two, so a 272 MB gradient buffer locks 512 MB. From ``REGISTER_MIN_BYTES`` up we allocate an
ordinary host tensor and lock exactly its pages with ``cudaHostRegister``; smaller buffers
use ``pin_memory`` (the rounding costs little there). Without CUDA a buffer is a plain tensor:
the host transport never copies, so nothing needs locking.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional

import torch

from .state import host_empty

REGISTER_MIN_BYTES = 1 << 20
# cudaHostRegisterPortable: pinned for every CUDA context, so any device's streams may use it.
_REGISTER_PORTABLE = 1

_log = logging.getLogger("adambridge")


def _cudart() -> Any:
    """The CUDA runtime bindings (a function so tests can substitute a fake)."""
    return torch.cuda.cudart()


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _unregister(cudart_fn: Callable[[], Any], address: int, tensor: torch.Tensor) -> None:
    # ``tensor`` is an argument only so that the memory outlives its registration: the
    # finalizer holds it until cudaHostUnregister has returned.
    status = int(cudart_fn().cudaHostUnregister(address))
    if status != 0:
        _log.warning("cudaHostUnregister(0x%x) failed with cudaError %d; the pages stay locked "
                     "until the process exits", address, status)
    del tensor


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
            self.tensor = host_empty(numel, dtype)
            self._register()

    def _register(self) -> None:
        address = self.tensor.data_ptr()
        status = int(_cudart().cudaHostRegister(address, self.nbytes, _REGISTER_PORTABLE))
        if status != 0:
            raise RuntimeError(f"cudaHostRegister of a {self.nbytes}-byte buffer failed with "
                               f"cudaError {status}; the host may be out of lockable memory "
                               f"(check `ulimit -l`), or an earlier CUDA error is pending")
        self._finalizer = weakref.finalize(self, _unregister, _cudart, address, self.tensor)
        # At interpreter exit the OS reclaims everything; calling into CUDA then can crash.
        self._finalizer.atexit = False

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def close(self) -> None:
        """Unlock the pages now (idempotent). Call only when no copy uses the buffer."""
        if self._finalizer is not None:
            self._finalizer()


def pinned_empty(numel: int, dtype: torch.dtype) -> PinnedBuffer:
    """An uninitialised exact-size page-locked buffer (plain host memory without CUDA)."""
    return PinnedBuffer(numel, dtype)
