"""adamw_update(items): one multi-tensor AdamW call, routed to the native kernel or to torch.

An UpdateItem is a contiguous range of one parameter's host state (a whole parameter, a
chunk or, later, a shard); the optimizer and the pipeline build them, this module runs them.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import reference
from .items import Hyper, UpdateItem  # noqa: F401 (also imported from here by the callers)

PRECISIONS = ("fp32", "bf16", "fp8")
BACKENDS = ("auto", "native", "torch")


class NativeBatch:
    """A fixed list of UpdateItems packed once into native descriptors, for repeated steps.

    ``adamw_update`` checks and packs every item on every call (about a microsecond per item);
    a caller that updates the same ranges step after step builds a NativeBatch once and then
    refreshes only what changes: ``set_step`` (stream keys, hyperparameters) and, when the
    gradient tensors are new, ``set_grads``. Everything else (master, moments, scales, copy,
    offset, precision) is fixed at construction: rebuild the batch when any of those tensors
    is replaced. The batch keeps the items (and so their tensors) alive.
    """

    def __init__(self, items: Sequence[UpdateItem]):
        from .._native import loader
        self.items = list(items)
        self._loader = loader
        self._desc = loader.descriptors(self.items)
        self._numels = [item.numel for item in self.items]
        self._grad_dtypes = None  # as the dtype column was last written by set_grads

    def __len__(self) -> int:
        return len(self.items)

    def set_step(self, keys, hyper, index=None) -> None:
        """keys: one stream key per item (a list or int64 tensor, see ``stream_keys``);
        hyper: one Hyper for all items, or a sequence of one per item; with ``index`` (an
        int64 tensor, one entry per item), a short sequence that item i takes entry index[i] of.
        """
        self._loader.set_keys(self._desc, keys)
        self._loader.set_hyper(self._desc, hyper, index)

    def set_grads(self, grads: Sequence[torch.Tensor], *, numels_checked: bool = False) -> list:
        """New gradient tensors (one per item, same numel; dtype may change), checked; returns
        their data pointers. ``numels_checked=True``: the caller has already checked that each
        gradient has its item's element count (say, the parameter's shape), which is then not
        read again; every other check (dtype, CPU, contiguity, pointer) still runs.

        The items then hold the new gradients, so the old ones are not kept alive.
        """
        grads = list(grads)
        pointers, self._grad_dtypes = self._loader.set_grads(
            self._desc, grads, None if numels_checked else self._numels, self._grad_dtypes)
        for item, grad in zip(self.items, grads):
            item.grad = grad
        return pointers

    def take_checked_grads(self, grads: Sequence[torch.Tensor], pointers: Sequence[int]) -> None:
        """New gradient tensors the caller has checked as ``set_grads`` would (contiguous, on
        the CPU, each its item's element count) whose dtypes are those of the last
        ``set_grads`` (or construction), with their ``data_ptr()``s: only the pointer column
        is written. Anything unchecked goes through ``set_grads``.
        """
        self._loader.set_grad_pointers(self._desc, pointers)
        for item, grad in zip(self.items, grads):
            item.grad = grad

    def run(self) -> None:
        """One native call over the whole batch."""
        self._loader.run(self._desc)


def stream_keys(seed: int, step: int, param_indices) -> torch.Tensor:
    """``codecs.stream_key(seed, step, i)`` for many parameter indices i at once (int64)."""
    from .codecs import MASK32, mix32_tensor, step_key
    indices = torch.as_tensor(param_indices, dtype=torch.int64) & MASK32
    return mix32_tensor(indices ^ step_key(seed, step))


def adamw_update(items: Sequence[UpdateItem], backend: str = "native") -> None:
    """Update every item in place: one native call for the whole batch, or the torch loop."""
    if not items:
        return
    if backend == "native":
        from .._native import loader
        loader.update(items)
    elif backend == "torch":
        for item in items:
            reference.update_range(item)
    else:
        raise ValueError(f"Invalid backend: {backend!r} (valid: 'native', 'torch')")
