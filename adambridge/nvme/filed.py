"""The NVMe tier's ``state_dict()`` entries: tensors whose values are read from the tier's files when something reads them.

The tier exists for states larger than RAM, so ``state_dict()`` must not read them into RAM:
each file-placed tensor of the saved form (``master``, the moments, fp8's codes and scales)
is a ``FiledTensor`` (host/sourced.py) pinned to the parameter's committed generation. A
save then streams: ``torch.distributed.checkpoint`` and ``adambridge.checkpoint.save`` take
one tensor at a time, read it, write it and let it go (plain ``torch.save`` holds every
tensor it pickles until the end, by its design, so it holds the state once).

- Reads: every operation, ``print``, pickling, ``copy.deepcopy`` and ``numpy()`` get the
  committed values, read page by page. The parameter's other tensors read with them are
  kept until taken (one parameter's state at most), so a save reads each page once.
- Writes (``dcp.load`` into the dict, ``copy_``): the entry's values are read into a tensor
  of its own first, and from then on the entry is that tensor (nothing reaches the files:
  ``opt.load_state_dict(sd)`` writes them).
- Pinned: the tier writes each step into the other of two slots, so the slot of the
  generation an entry was taken at is rewritten two steps later (or by two loads). Before
  that write, and before the tier closes (``close()``, or the optimizer collected), every
  entry still alive that is pinned there is read into a tensor of its own: a dict kept
  across steps holds its values as a copy would (the whole state, as with any copy), and a
  dict dropped after its save never costs a read.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch

from ..host.sourced import DerivedSource, Source, SourcedTensor
from .direct_io import AlignedBuffer
from .layout import ParamFiles, read_state

aten = torch.ops.aten


class Pinned:
    """One file-placed parameter at one committed generation: its tensors, read on demand."""

    __slots__ = ("_tier", "files", "generation", "step", "epoch", "live")

    def __init__(self, tier: Any, files: ParamFiles, generation: int, step: int,
                 live: Any) -> None:
        self._tier = weakref.ref(tier)  # a dict kept past the optimizer must not keep its files
        self.files, self.generation, self.step = files, generation, step
        self.epoch = tier.slot_epoch(files.index, generation)
        self.live = live  # the tier's WeakSet of the FiledParts still alive

    def read(self, key: str) -> torch.Tensor:
        tier = self._tier()
        if tier is None:
            raise RuntimeError(f"adambridge: this state_dict() entry of parameter "
                               f"{self.files.index} was read from the NVMe tier's files of an "
                               f"optimizer that no longer exists; read it (or save it) before "
                               f"the optimizer goes")
        return tier.read_pinned(self, key)


class FiledPart(Source):
    """One tensor (``key``) of a Pinned parameter; its own copy once written."""

    __slots__ = ("pinned", "key", "own", "__weakref__")  # the tier keeps a WeakSet of them
    fresh_snapshots = True  # a read makes the values anew: it needs no copy of its own

    def __init__(self, pinned: Pinned, key: str) -> None:
        self.pinned, self.key, self.device = pinned, key, torch.device("cpu")
        self.own: Optional[torch.Tensor] = None
        pinned.live.add(self)  # its values are kept before its slot is rewritten

    def read(self) -> torch.Tensor:
        return self.own if self.own is not None else self.pinned.read(self.key)

    def snapshot(self) -> torch.Tensor:
        return self.own.clone() if self.own is not None else self.pinned.read(self.key)

    def open_write(self) -> torch.Tensor:
        if self.own is None:
            self.own = self.pinned.read(self.key)  # from now on the entry is this tensor
        return self.own


class FiledTensor(SourcedTensor):
    """A state_dict() entry of a file-placed parameter (see the module's docstring)."""

    __slots__ = ()

    SHAPE_CHANGE_REFUSAL = ("adambridge: .{name}() changes the shape of an NVMe-tier "
                            "state_dict() entry in place, which it cannot follow (its values "
                            "are in the tier's files); make a new tensor instead "
                            "(x = x.{call}(...))")

    @classmethod
    def _dispatch(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten.is_pinned.default:
            return False  # (DCP asks each tensor: no read for that)
        if func is aten.clone.default or (func is aten._to_copy.default
                                          and _same_kind(args[0], kwargs)):
            copy = _unread_copy(args[0], kwargs)
            if copy is not None:
                return copy
        return super()._dispatch(func, args, kwargs)


def _same_kind(tensor: FiledTensor, kwargs: dict) -> bool:
    """Whether a ``_to_copy`` (``.cpu()``, ``.to(dtype)``) asks for a tensor like this one."""
    wanted = {"dtype": tensor.dtype, "device": tensor.device, "layout": torch.strided}
    return (all(kwargs.get(key) in (None, value) for key, value in wanted.items())
            and not kwargs.get("pin_memory"))


def _unread_copy(tensor: FiledTensor, kwargs: dict) -> Optional[FiledTensor]:
    """``tensor.clone()`` as another entry of the same committed pages, nothing read, where
    ``tensor`` is a whole, unwritten entry (a reshape of it, a detach): the pages it reads
    stay as they are until its copy has kept them (keep_values), so the copy is independent.

    NOTE: torch.distributed.checkpoint copies each tensor it saves (``.cpu()``, which is a
    copy for a tensor without storage, or ``clone()``) and keeps every copy until its file
    is closed; plain copies would hold the whole state."""
    root = tensor
    while isinstance(root.source, DerivedSource):
        root = root.source.parent
    part = root.source
    if not isinstance(part, FiledPart) or part.own is not None:
        return None
    if (tensor.numel() != root.numel() or not tensor.is_contiguous()
            or tensor.storage_offset() != 0
            or kwargs.get("memory_format") not in (None, torch.preserve_format,
                                                   torch.contiguous_format)):
        return None
    copy = FiledTensor(root, FiledPart(part.pinned, part.key))
    return copy.view(tensor.shape)


def filed_state(tier: Any, files: ParamFiles, generation: int, step: int,
                live: Any) -> dict:
    """The committed state of one file-placed parameter, as opt.state[p] keys: ``step`` in
    RAM, every other tensor a FiledTensor read from the files on demand (its source added
    to ``live``, the tier's WeakSet)."""
    pinned = Pinned(tier, files, generation, step, live)
    state: dict[str, Any] = {"step": torch.tensor(float(step), dtype=torch.float32)}
    for key, dtype, numel in files.part_shapes():
        state[key] = FiledTensor(_HostLike(numel, dtype), FiledPart(pinned, key))
    return state


class _HostLike:
    """The shape, strides, dtype and device of a flat host tensor, for a FiledTensor."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.shape, self.dtype, self.device = torch.Size([numel]), dtype, torch.device("cpu")

    def stride(self) -> tuple:
        return (1,)


def keep_values(parts: Iterable[FiledPart]) -> None:
    """Read every part of ``parts`` that has no tensor of its own yet into one (its files
    are about to be rewritten or closed): one read of each parameter's pages."""
    waiting: dict = defaultdict(list)
    for part in list(parts):
        if part.own is None:
            waiting[part.pinned].append(part)
    for pinned, group in waiting.items():
        buffer = AlignedBuffer(pinned.files.layout.record_bytes)
        state = read_state(pinned.files, buffer, pinned.generation, pinned.step)
        for part in group:
            part.own = state[part.key]
