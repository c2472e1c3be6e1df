"""``adambridge.checkpoint.save``: torch.save's file, written one tensor at a time.

``torch.save`` pickles the whole object first, keeping every storage it meets, and writes
their bytes at the end: every tensor is in memory at once. That costs nothing for tensors
that live in memory anyway (a model's, an in-RAM optimizer's state), but an NVMe tier's
``state_dict()`` entries are read from files when pickled (nvme/filed.py), so torch.save
holds the whole file-placed state in RAM while it runs. ``save`` writes the same zip
archive (``torch.load`` reads it, ``mmap=True`` and ``weights_only=True`` included) with
each tensor's bytes written as the pickler meets it: a tensor whose values live elsewhere
(a ``SourcedTensor``) is read, written and let go before the next one is read.

Saved to a path, the file is written under a temporary name beside it, flushed to the
drive and renamed over the target: a kill at any moment leaves the previous checkpoint
whole, and a full drive raises one line naming the path and the space needed.
"""
from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch
from torch import serialization

from ..host import platform_facts
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
    To a path, it is atomic: written beside the target as ``.NAME.PID.adambridge-partial``,
    flushed to the drive (fsync), then renamed over ``f``, so ``f`` always holds a whole
    checkpoint, the previous one until the new one is complete. A file object is written
    in place.
    """
    if not isinstance(f, (str, os.PathLike)):
        _write(obj, f)
        return
    target = Path(os.fspath(f))
    _remove_stale_partials(target)
    free = _free_bytes(target)
    partial = target.with_name(f".{target.name}.{os.getpid()}.adambridge-partial")
    try:
        _write(obj, str(partial))
        _sync_file(partial)
        platform_facts.replace(partial, target)
    except BaseException as exc:
        _remove(partial)
        if _out_of_space(exc, target):
            _drop_frames(exc)
            raise OSError(errno.ENOSPC, _no_space_message(obj, target, free)) from None
        raise
    platform_facts.sync_directory(target.parent)


def _write(obj: Any, f: Union[str, IO[bytes]]) -> None:
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


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        platform_facts.data_sync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale_partials(target: Path) -> None:
    """Partial files of this target left by a save that was killed (its process is gone)."""
    prefix = f".{target.name}."
    try:
        names = os.listdir(target.parent)
    except OSError:
        return  # the write below says what is wrong with the directory
    for name in names:
        if name.startswith(prefix) and name.endswith(".adambridge-partial"):
            pid = name[len(prefix):-len(".adambridge-partial")]
            if pid.isdigit() and not _alive(int(pid)):
                _remove(target.parent / name)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process, or no way to ask: leave its file alone
    return True


def _out_of_space(exc: BaseException, target: Path) -> bool:
    """Whether ``exc`` came from a full drive (torch's writer says only ``unexpected pos``)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(exc, (OSError, RuntimeError)):
        return False
    free = _free_bytes(target)
    return free is not None and free < (1 << 20)


def _drop_frames(exc: Optional[BaseException]) -> None:
    """Let the frames of a failed write go, and with them torch's writer and its descriptor
    of the removed partial file: until it is closed, the drive stays full."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__context__


def _free_bytes(target: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(target.parent).free
    except OSError:
        return None


def _no_space_message(obj: Any, target: Path, free: Optional[int]) -> str:
    had = "" if free is None else f", {free / 1e6:.1f} MB were free"
    return (f"adambridge.checkpoint.save: no space left on the drive of {target}: the "
            f"checkpoint needs about {_tensor_bytes(obj) / 1e6:.1f} MB{had}; free space "
            f"there or save to another drive (the previous {target.name}, if any, is "
            f"untouched)")


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples walked; each storage once)."""
    seen, total, todo = set(), 0, [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, torch.Tensor):
            key = id(item) if isinstance(item, SourcedTensor) else \
                item.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += item.numel() * item.element_size() if isinstance(item, SourcedTensor) \
                    else item.untyped_storage().nbytes()
    return total
