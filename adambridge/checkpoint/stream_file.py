"""``adambridge.checkpoint.save``: torch.save's file, written one tensor at a time.

``torch.save`` pickles the whole object first, keeping every storage it meets, and writes
their bytes at the end: every tensor is in memory at once. That costs nothing for tensors
that live in memory anyway (a model's, an in-RAM optimizer's state), but an NVMe tier's
``state_dict()`` entries are read from files when pickled (nvme/filed.py), so torch.save
holds the whole file-placed state in RAM while it runs. ``save`` writes the same zip
archive (``torch.load`` reads it, ``mmap=True`` and ``weights_only=True`` included) with
each tensor's bytes written as the pickler meets it: a tensor whose values live elsewhere
(a ``SourcedTensor``) is read, written and let go before the next one is read.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from typing import IO, Any, Union

import torch
from torch import serialization

from ..host.sourced import SourcedTensor

_PROTOCOL = 2  # torch.save's default
# How torch pickles a plain host tensor: (storage, offset, size, stride, ...); v3 (the
# float8 dtypes and others without a typed storage) passes an UntypedStorage and the dtype.
_REBUILDS_FROM_STORAGE = (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3)


class _Record:
    """What the pickle holds in place of a storage already written (its persistent id):
    the storage itself would be kept alive by the pickler's memo until the end."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _StreamingPickler(pickle.Pickler):
    """A pickler that writes each storage it meets into the archive at once."""

    def __init__(self, data: IO[bytes], archive: Any) -> None:
        super().__init__(data, protocol=_PROTOCOL)
        self._archive = archive
        self._keys: dict = {}   # storage._cdata -> key, for storages that stay alive
        self._alive: list = []  # those storages: their addresses cannot be reused meanwhile
        self._dtypes: dict = {}
        self._count = 0

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, SourcedTensor):
            return NotImplemented
        values = obj.source.snapshot()  # read now, written now, let go now
        reduced = values.__reduce_ex__(_PROTOCOL)
        if reduced[0] not in _REBUILDS_FROM_STORAGE:
            return reduced  # (a tensor with Python state: pickled as torch.save would)
        rebuild, args = reduced[:2]
        record = _Record(self._write(args[0], keep=False))
        return (rebuild, (record,) + tuple(args[1:]))

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Record):
            return obj.pid
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            return self._write(obj, keep=True)
        return None

    def _write(self, obj: Any, keep: bool) -> tuple:
        """The persistent id of ``obj`` (a storage), its bytes written unless they were."""
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            kind, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        else:
            storage, dtype = obj, torch.uint8
            kind, numel = serialization.normalize_storage_type(type(obj)), obj.nbytes()
        if keep and storage._cdata in self._keys:
            key = self._keys[storage._cdata]
            if self._dtypes[key] != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the "
                                   "same data as different types")
        else:
            key = str(self._count)
            self._count += 1
            self._dtypes[key] = dtype
            # A device storage is copied to the host for the write, as torch.save does.
            host = storage if storage.device.type == "cpu" else storage.cpu()
            self._archive.write_record(f"data/{key}", host, host.nbytes())
            if keep:
                self._keys[storage._cdata] = key
                self._alive.append(storage)
        return ("storage", kind, key, serialization.location_tag(storage), numel)


def save(obj: Any, f: Union[str, os.PathLike, IO[bytes]]) -> None:
    """``torch.save(obj, f)``, writing each tensor as it is met: the NVMe tier's state_dict()
    entries are read one at a time, so the save holds one tensor of them, not all.

    The file is torch.save's format; load it with ``torch.load`` (``mmap=True`` included).
    """
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    with serialization._open_zipfile_writer(f) as archive:
        data = io.BytesIO()
        pickler = _StreamingPickler(data, archive)
        pickler.dump(obj)
        del pickler  # its memo and the storages it kept alive
        archive.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
        archive.write_record(".format_version", "1", 1)
        alignment = str(serialization._get_storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
