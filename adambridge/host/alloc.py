"""Host memory for the optimizer's state and buffers: plain (not pinned) allocations, with
transparent huge pages asked for where they pay (fewer TLB misses on the streamed state)."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache
from typing import Optional

import torch


HUGE_PAGE = 2 << 20  # bytes of one transparent huge page (x86-64, arm64 with 4 KiB pages)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+


@lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _huge_interior(tensor: torch.Tensor, min_bytes: int) -> Optional[tuple]:
    """(address, length) of the whole huge pages inside a tensor of at least ``min_bytes``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < min_bytes:
        return None
    start = tensor.data_ptr()
    aligned = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (start + nbytes - aligned) // HUGE_PAGE * HUGE_PAGE
    return (aligned, length) if length > 0 else None


def advise_huge_pages(tensor: torch.Tensor, min_bytes: int = 2 * HUGE_PAGE) -> None:
    """Ask Linux to back a large buffer with transparent huge pages (before first touch):
    the whole huge pages inside it, if it has at least ``min_bytes``.

    NOTE: without huge pages the update's reads fall from ~31 to ~22 GB/s on the
    reference VM (docs/architecture.md); THP is often in 'madvise' mode, so we must ask.
    """
    libc, interior = _libc(), _huge_interior(tensor, min_bytes)
    if libc is not None and interior is not None:
        libc.madvise(ctypes.c_void_p(interior[0]), ctypes.c_size_t(interior[1]), _MADV_HUGEPAGE)


def collapse_huge_pages(tensor: torch.Tensor) -> None:
    """Put a large buffer that is already written (a loaded checkpoint's tensor, kept as the
    state) on transparent huge pages now, one huge page at a time (MADV_COLLAPSE copies each
    and frees the small pages); where the kernel cannot (before Linux 6.1, no free huge
    page), advise them, for khugepaged to collapse in its own time (which, at its default
    pace of 16 MiB per 10 s, can take hours for a large state)."""
    libc, interior = _libc(), _huge_interior(tensor, 2 * HUGE_PAGE)
    if libc is None or interior is None:
        return
    address, length = ctypes.c_void_p(interior[0]), ctypes.c_size_t(interior[1])
    libc.madvise(address, length, _MADV_HUGEPAGE)  # also keeps them huge past a collapse
    libc.madvise(address, length, _MADV_COLLAPSE)


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat host tensor, huge-page advised when large."""
    tensor = torch.empty(numel, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return host_empty(numel, dtype).zero_()
