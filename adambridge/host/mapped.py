"""Tensors that live in a file mapping (``torch.load(f, mmap=True)``): finding them, and handing their pages back.

A checkpoint loaded with ``mmap=True`` holds its tensors in a private mapping of the file.
The optimizer must not keep such a tensor as its state: a later ``torch.save`` to the same
path truncates and rewrites the file, and the kernel then drops or replaces the mapped pages
(even those the process already wrote), so the state would change under it or fault. A load
copies such tensors into host memory instead, 8 MiB at a time, and hands the pages it has
read back to the kernel (``MADV_PAGEOUT``, which keeps their contents: a clean page is read
again from the file if touched), so the mapping never holds more than a few MiB of it.

Linux only reads its mappings (``/proc/self/maps``); elsewhere every tensor counts as mapped,
so loads copy (correct, at the cost of memory) and no page is handed back.
"""
from __future__ import annotations

import bisect
import ctypes
import os
from typing import Iterator, Optional

import torch

from .alloc import HUGE_PAGE, _libc

MAPS = "/proc/self/maps"
_MADV_PAGEOUT = 21  # Linux 5.4+; older kernels answer EINVAL and keep the pages


class Mappings:
    """The address ranges of this process's file mappings, read once (at a load's start:
    the load itself maps no files)."""

    def __init__(self, maps_path: Optional[str] = None) -> None:
        maps_path = maps_path or MAPS
        self.known = os.path.exists(maps_path)
        self._starts: list[int] = []
        self._ends: list[int] = []
        if self.known:
            for first, end in sorted(_file_ranges(maps_path)):
                self._starts.append(first)
                self._ends.append(end)

    def _around(self, tensor: torch.Tensor) -> Optional[tuple]:
        """(start, end) of the file mapping holding ``tensor``'s first byte, or None."""
        address = tensor.untyped_storage().data_ptr()
        i = bisect.bisect_right(self._starts, address) - 1
        return (self._starts[i], self._ends[i]) if i >= 0 and self._ends[i] > address else None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a CPU tensor) lies in a file mapping; True where this system
        does not say."""
        if not self.known:
            return True
        return tensor.untyped_storage().nbytes() > 0 and self._around(tensor) is not None

    def release(self, tensor: torch.Tensor) -> None:
        """Hand the pages under ``tensor`` back to the kernel if it lies in a file mapping;
        their contents stay (MADV_PAGEOUT drops a clean page, to be read again from the
        file if touched, and writes nothing away that it cannot read back).

        NOTE: the page cache may hold a file in large folios (2 MiB), which MADV_PAGEOUT
        skips unless its range covers the whole folio; so the range is widened to 2 MiB
        boundaries, within the file mapping: a neighbour's clean pages handed back with it
        are only read again. A no-op where the kernel or the system lacks it."""
        libc = _libc()
        around = self._around(tensor) if self.known and libc is not None else None
        if around is None or tensor.numel() == 0:
            return
        first = max(tensor.data_ptr() // HUGE_PAGE * HUGE_PAGE, around[0])
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        end = min(-(-end // HUGE_PAGE) * HUGE_PAGE, around[1])
        if end > first:
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_PAGEOUT)

    def pieces(self, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, piece) over flat tensor ``flat``: all of it at once, or, where it lies
        in a file mapping, 8 MiB at a time, each piece's pages handed back once the caller
        is done with it (so reading a mapped tensor holds 8 MiB of it, not all of it)."""
        if not self.holds(flat):
            yield 0, flat
            return
        step = max(1, PIECE // flat.element_size())
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            yield start, piece
            self.release(piece)


def _file_ranges(maps_path: str) -> list[tuple[int, int]]:
    """(start, end) of every mapping with a file behind it (an inode), /dev/shm included."""
    ranges = []
    with open(maps_path) as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 5 and fields[4] != "0":
                start, _, end = fields[0].partition("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


PIECE = 8 << 20  # bytes of a mapped tensor read before its pages are handed back


def storage_shared(tensor: torch.Tensor) -> bool:
    """Whether another tensor than ``tensor`` views its storage (a view handed out by a
    state_dict(), two saved tensors torch.save stored once, a slice of a larger buffer).

    NOTE: torch counts the tensors (and Python storage objects) that hold a storage; the
    ``untyped_storage()`` asked for here is one of them, so a storage only ``tensor``
    holds counts 2.
    """
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) > 2 or \
        storage.nbytes() != tensor.numel() * tensor.element_size()
