"""The native descriptor row of each whole-parameter piece: packed once, refreshed every step.

NOTE (the async pipeline's per-gradient cost): Building an UpdateItem and packing
it took ~10 us a gradient on the worker thread: Python under the GIL, so backward waited for
it. A hooked parameter updated whole (one piece, the native backend) keeps its packed
``struct ab_tensor`` row between steps, with the facts it was packed from: weak references
to the state tensors whose addresses it holds, p's data pointer and the rounding flag. Each
step the worker checks those facts (identity and integer compares), then writes only what
changes per step: the gradient and copy pointers (checked as the loader checks them), the
stream key and the hyperparameters. A piece whose facts do not hold (a first update, new
state tensors, ``p.data`` replaced, a chunk) gets its item built and a fresh row packed by
the loader, every pointer checked; its row is then kept for the next step.
"""
from __future__ import annotations

import ctypes
import struct
import weakref
from itertools import repeat
from operator import call, is_, is_not
from typing import Any, Callable, Optional

import torch

from .._native import loader
from ..update.codecs import MASK32, mix32, step_key
from ..update.functional import Hyper

_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
_GRAD = loader.AbTensor.grad.offset
_OUT = loader.AbTensor.out.offset
_KEY = loader.AbTensor.key.offset            # key, then grad_dtype (both 32-bit)
_OUT_CODE = loader.AbTensor.out_dtype.offset
_HYPER = loader.AbTensor.hparams.offset
_POINTER = struct.Struct("=Q")
_KEY_AND_DTYPE = struct.Struct("=Ii")
_CODE = struct.Struct("=i")
_HYPER_ROW = struct.Struct(f"={len(loader.HYPER_FIELDS) + 1}f")  # + the reserved float


class PieceRow:
    """One piece's packed row and the facts it holds for (see the module docstring)."""

    __slots__ = ("row", "keys", "refs", "pointers", "p_pointer", "rounding", "out_code")

    def __init__(self, row: bytearray, state: dict, p: torch.Tensor, rounding: bool) -> None:
        self.row = row
        # The state tensors whose addresses the row holds (the scales only in fp8 rows: any
        # change of precision replaces the moments, which are always checked).
        self.keys = _STATE_KEYS if state.get("exp_avg_scale") is not None else _STATE_KEYS[:3]
        self.refs = tuple(weakref.ref(state[k]) for k in self.keys)
        # and their addresses: the same tensor can be given new storage (t.data = ...)
        self.pointers = tuple(state[k].data_ptr() for k in self.keys)
        self.p_pointer = p.data_ptr()
        self.rounding = rounding
        self.out_code = _CODE.unpack_from(row, _OUT_CODE)[0]

    def holds(self, state: dict, p: torch.Tensor, rounding: bool,
              out: Optional[torch.Tensor]) -> bool:
        """Whether the fixed part of the row still describes p's state and p."""
        if not (self.p_pointer == p.data_ptr() and self.rounding == rounding
                and (out is None) == (self.out_code == loader.AB_NONE)):
            return False
        tensors = tuple(map(state.get, self.keys))
        return (all(map(is_not, tensors, repeat(None)))  # (a dead ref is None too)
                and all(map(is_, map(call, self.refs), tensors))
                and tuple(map(torch.Tensor.data_ptr, tensors)) == self.pointers)


class RowPacker:
    """Packs one batch of pieces into a descriptor buffer (one per worker call)."""

    def __init__(self) -> None:
        # (id(group), seed, step) -> (hyper bytes, step key, the Hyper)
        self._per_step: dict = {}

    def _step_facts(self, group: dict, seed: int, step: int) -> tuple[bytes, int, Hyper]:
        key = (id(group), seed, step)  # the group is alive for the whole batch: its id is stable
        facts = self._per_step.get(key)
        if facts is None:
            hyper = Hyper.for_group(group, step)
            facts = self._per_step[key] = (
                _HYPER_ROW.pack(*(getattr(hyper, f) for f in loader.HYPER_FIELDS), 0.0),
                step_key(seed, step), hyper)
        return facts

    def refresh(self, piece: Any) -> bool:
        """Write this step's pointers, key and hyperparameters into piece's kept row; False
        when there is none or its facts no longer hold (the caller packs a fresh one)."""
        kept, job = piece.row, piece.job
        state, p, out = job.state, job.p, job.out
        if kept is None or state is None or job.source is not None:
            return False
        opt = job.opt
        if not kept.holds(state, p, opt.stochastic_rounding, out):
            return False
        n, row = piece.end, kept.row
        if out is not None:
            out_pointer, out_code = loader.checked_column(out, "out", n)
            if out_code != kept.out_code:
                return False
            _POINTER.pack_into(row, _OUT, out_pointer)
        grad_pointer, grad_code = loader.checked_column(job.grad, "grad", n)
        _POINTER.pack_into(row, _GRAD, grad_pointer)
        hyper_row, key, piece.hyper = self._step_facts(job.group, opt.seed, job.step)
        # stream_key(seed, step, index), with the step's part computed once per batch
        _KEY_AND_DTYPE.pack_into(row, _KEY, mix32(key ^ (job.index & MASK32)), grad_code)
        row[_HYPER:_HYPER + _HYPER_ROW.size] = hyper_row
        return True


def whole(piece: Any) -> bool:
    """Whether ``piece`` covers its whole parameter (only those keep a row)."""
    return piece.start == 0 and piece.end == piece.job.p.numel()


def pack(batch: list, item_of: Callable[[Any], Any]) -> ctypes.Array:
    """The descriptor rows of ``batch``: a ctypes array of ``struct ab_tensor``.

    ``item_of(piece)`` builds a piece's UpdateItem (and makes its state on a first update)
    for the pieces whose kept row cannot be refreshed.
    """
    packer = RowPacker()
    rows = []
    for piece in batch:
        if not packer.refresh(piece):
            item = item_of(piece)
            desc = loader.descriptors([item])  # every pointer checked by the loader
            row = bytearray(ctypes.string_at(desc.data_ptr(), loader.DESC_BYTES))
            if whole(piece):
                piece.row = PieceRow(row, piece.job.state, piece.job.p,
                                     piece.job.opt.stochastic_rounding)
            rows.append(row)
            continue
        rows.append(piece.row.row)
    # (ctypes, not a torch tensor: a torch call lets the GIL go, and a worker that lets it
    # go waits for the autograd thread to hand it back, then makes that thread wait)
    return (loader.AbTensor * len(rows)).from_buffer(bytearray(b"".join(rows)))


def run(rows: ctypes.Array) -> None:
    """One native call over every row (the GIL is released during it)."""
    native = loader.load()
    native.check(native.lib.ab_adamw_update(rows, len(rows)), "ab_adamw_update")
